"""The agreements' one exchange on a duplicate (checked.py): every rank's slot
(a header of ``HEADER`` words, then up to ``inline_capacity(size)`` bytes of
a small call's data) gathered into every rank's slots by one Allgather of a
fixed size. It is the same operation on every rank whatever call it agrees,
so the ranks' agreements match however their calls differ.

Where the MPI library has MPI-4's persistent collectives, the Allgather is
made once with the duplicate (``Allgather_init``, by the watch: collective,
every rank makes its duplicate's in the same order) and each agreement
starts it (``Communicator.start_agreement``): a small call's agreement then
costs 5 us less than a new Iallgather of the same buffers (its arguments
parsed, its schedule made: 20 -> 15 us for a 1 KiB ``mpigrad.allreduce`` at 2
ranks here). Elsewhere each agreement is a new Iallgather of these buffers."""

from typing import Any, Optional, Tuple

import numpy as np
from mpi4py import MPI

__all__ = ["Exchange", "HEADER", "inline_capacity"]

#: the words of a slot's header (checked.py: failed, fingerprint, extra, bits, inline)
HEADER = 5


def inline_capacity(size: int) -> int:
    """The bytes a call may carry in its agreement over ``size`` ranks: the
    agreement gathers every rank's slot, so a slot shrinks as the ranks grow
    (16 KiB gathered in all): 4 KiB up to 4 ranks, 512 bytes at 32, none past
    2048."""
    return min(4096, 16384 // max(size, 1)) // 8 * 8 if size <= 2048 else 0


class Exchange:
    """A duplicate's agreement buffers: this rank's ``slot`` and every rank's
    ``slots`` (ranks, words), valid until the next agreement; ``request``:
    their persistent Allgather, or None where the library has none (or it is
    not made yet)."""

    __slots__ = ("slot", "slots", "buffers", "request", "moves", "header_of")

    def __init__(self, size: int) -> None:
        words = HEADER + inline_capacity(size) // 8
        self.slot = np.zeros(words, np.int64)
        self.slots = np.zeros((size, words), np.int64)
        self.buffers: Tuple[Any, Any] = ([self.slot, MPI.INT64_T], [self.slots, MPI.INT64_T])
        self.request: Optional[MPI.Prequest] = None
        #: the bytes a rank sends in one exchange, by the operation's definition
        self.moves = self.slots.nbytes * (size - 1) // size
        #: whose header the slot holds (a Carrying writes its own only where it does
        #: not: the same small call every step); None: anyone's
        self.header_of: Any = None

    def free(self) -> None:
        """Free the persistent request (inactive: no agreement in flight)."""
        if self.request is not None:
            self.request.Free()
            self.request = None

"""BROADCAST: root's arrays and payload in one ``Bcast`` of their bytes (in
pieces of at most 1 GiB: MPI counts are ints); the others' arrays
overwritten, root's payload handed back to every rank. The agreement gives
the payload's size (``extra``: root's, the largest of any rank)."""

from typing import List, Optional

import numpy as np

from .._comm.checked import Pending
from .._comm.communicator import Communicator, Started
from .memory import as_bytes, unpack
from .spec import Carriage, Collective

__all__ = ["check", "extra", "carriage", "start", "PIECE"]


#: bytes of one Bcast at most (MPI counts are ints)
PIECE = 1 << 30


def check(spec: Collective, comm: Communicator) -> None:
    """Nothing beyond the agreement (the root is checked where it is made)."""


def extra(spec: Collective) -> int:
    """What this rank adds to the agreement's ``extra``: its payload's size."""
    return len(spec.payload or b"")


def carriage(spec: Collective, comm: Communicator, capacity: int) -> Optional[Carriage]:
    """Nothing is carried in the agreement: the data moves after it."""
    return None


def start(spec: Collective, comm: Communicator, extra: int) -> Pending:
    """Start root's broadcast; its Pending unpacks and gives root's payload
    (None where the call carries none)."""
    assert spec.root is not None
    sizes = [a.nbytes for a in spec.sends]
    buf = np.empty(sum(sizes) + extra, np.uint8)
    mine = comm.rank == spec.root
    if mine:
        offset = 0
        for array, n in zip(spec.sends, sizes):
            buf[offset:offset + n] = as_bytes(array)
            offset += n
        buf[offset:] = np.frombuffer(spec.payload or b"", np.uint8)
    what = f"broadcast of {spec.name}"
    started: List[Started] = [comm.start_bcast(buf[lo:lo + PIECE], spec.root, what)
                              for lo in range(0, buf.size, PIECE)]

    def finish() -> Optional[bytes]:
        if not mine:
            unpack(buf, [as_bytes(a) for a in spec.sends])
        return buf[sum(sizes):].tobytes() if spec.payload is not None or extra else None
    return Pending(comm, started, finish)


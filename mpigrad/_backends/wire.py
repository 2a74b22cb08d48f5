"""The bfloat16 wire: a float32 sum over ranks that sends half the bytes.

Every rank rounds its float32 piece once to bfloat16 and sends each rank its share of it
(an Alltoallv: a reduce-scatter without MPI's sum); each rank sums the shares it received
in float32, in rank order, rounds the sum once to bfloat16, and the sums are gathered back
(an Allgatherv) and widened to float32. The error is one bfloat16 rounding of each addend
and one of the result, whatever the rank count (a ring that rounds at every hop grows with
it); every rank gets the same bits. Used where the Reducer's ``wire="bfloat16"`` applies:
float32 buckets summed through MPI, and the step across nodes of the node sums (node sums
stay float32).
"""

from typing import Optional

import numpy as np
from mpi4py import MPI

from .._base.halfcast import from_bfloat16_bits, sum_bfloat16_rows, to_bfloat16_bits
from .._base.ranges import shard_range
from .._comm.communicator import Communicator, Started, What

__all__ = ["WireSum", "compresses", "WINDOW"]

#: pieces in flight at once: while one piece's shares are summed, the next one's travel
WINDOW = 3


def compresses(wire: Optional[str], dtype: np.dtype) -> bool:
    """Whether ``wire`` changes how a bucket of ``dtype`` travels (float32 only)."""
    return wire == "bfloat16" and dtype == np.float32


class WireSum:
    """One float32 piece summed in place over a communicator through the bfloat16 wire, in
    two collectives: its Alltoallv starts here, its Allgatherv in ``start_second`` (a
    ``flight.Pipeline`` orders both alike on every rank)."""

    def __init__(self, communicator: Communicator, piece: np.ndarray, what: What,
                 comm: Optional[MPI.Comm] = None) -> None:
        self.communicator, self.piece, self.what, self.comm = communicator, piece, what, comm
        group = communicator.comm if comm is None else comm
        size, rank = group.Get_size(), group.Get_rank()
        self.counts = [hi - lo for lo, hi in (shard_range(piece.size, r, size)
                                              for r in range(size))]
        self.bits = np.empty(piece.size, np.uint16)
        to_bfloat16_bits(self.bits, piece)
        self.shares = np.empty((size, self.counts[rank]), np.uint16)
        self.first = communicator.start_alltoallv(
            self.bits, self.counts, self.shares.reshape(-1), [self.counts[rank]] * size,
            _named(what, "Alltoallv"), comm)
        self.second: Optional[Started] = None

    def test_first(self) -> bool:
        done: bool = self.first.request.Test()
        return done

    def wait_first(self) -> None:
        self.communicator.wait(self.first)

    def start_second(self) -> None:
        """Sum this rank's shares (float32, rank order, one rounding) and gather the sums."""
        mine = np.empty(self.shares.shape[1], np.uint16)
        sum_bfloat16_rows(mine, self.shares)
        self.second = self.communicator.start_allgatherv(
            mine, self.counts, self.bits, _named(self.what, "Allgatherv"), self.comm)

    def test_second(self) -> bool:
        assert self.second is not None
        if not self.second.request.Test():
            return False
        from_bfloat16_bits(self.piece, self.bits)
        return True

    def wait_second(self) -> None:
        assert self.second is not None
        self.communicator.wait(self.second)
        from_bfloat16_bits(self.piece, self.bits)


def _named(what: What, stage: str) -> What:
    def name() -> str:
        text = what() if callable(what) else what
        return f"{text} (bfloat16 wire: {stage})"
    return name

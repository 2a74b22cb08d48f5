"""The half-precision wires: a float32 sum over ranks that sends half the bytes.

Every rank rounds its float32 piece once to bfloat16 (or float16) and sends each rank its
share of it (an Alltoallv: a reduce-scatter without MPI's sum); each rank sums the shares it
received in float32, in rank order, rounds the sum once to the wire's dtype, and the sums
are gathered back (an Allgatherv) and widened to float32. The error is one rounding of each
addend and one of the result, whatever the rank count (a ring that rounds at every hop
grows with it); every rank gets the same bits. The sum is rounded as sum / 2^m (2^m the
smallest power of two at least the rank count: exact scaling), and multiplied back once
widened: it overflows the wire only where the mean of the addends would, not their sum
(a float16 wire carries a mean of 40000 over any rank count). Used where the Reducer's
``wire`` applies: float32 buckets summed through MPI, and the step across nodes of the node
sums (node sums stay float32); Horovod's ``Compression.bf16``/``fp16`` (mpigrad.horovod).
"""

from typing import Callable, Iterable, NamedTuple, Optional

import numpy as np
from mpi4py import MPI

from .._base.dtypes import wire_dtype
from .._base.fused_sum import sum_bfloat16_rows, sum_float16_rows
from .._base.halfcast import from_bfloat16_bits, to_bfloat16_bits, to_float16, to_float32
from .._base.ranges import shard_range
from .._comm.communicator import Communicator, Started, What

__all__ = ["WireSum", "compresses", "wire_for", "WINDOW"]

#: pieces in flight at once: while one piece's shares are summed, the next one's travel
WINDOW = 3


def wire_for(wire: Optional[str], dtypes: Iterable[Optional[np.dtype]]) -> Optional[str]:
    """The wire a call's float32 buckets travel, given the Reducer's ``wire`` and the
    call's dense gradients' ``dtypes``: never coarser than a gradient's own dtype.
    float16 and bfloat16 gradients are summed in float32 buckets; on the other half
    wire they would lose their own precision (float16's 3 bits on the bfloat16 wire)
    or range (bfloat16's values past 65504 on the float16 wire, and a second
    rounding): a call that holds them takes their own half's wire where they are the
    only gradients of float32 buckets, else no wire."""
    if wire is None:
        return None
    summed_in_float32 = {np.dtype(d) for d in dtypes
                         if d is not None and wire_dtype(d) == np.float32}
    halves = {d.name for d in summed_in_float32 if d.itemsize == 2}
    if halves <= {wire}:
        return wire
    return halves.pop() if len(summed_in_float32) == 1 else None


def compresses(wire: Optional[str], dtype: np.dtype) -> bool:
    """Whether ``wire`` changes how a bucket of ``dtype`` travels (float32 only)."""
    return wire is not None and dtype == np.float32


class _Kernels(NamedTuple):
    """A wire's kernels over the uint16 bits it sends."""

    down: Callable[[np.ndarray, np.ndarray], None]       # (bits, float32 piece): rounded
    # (bits, (k, n) bits, scale): summed, scaled by a power of two, rounded once
    sum_rows: Callable[[np.ndarray, np.ndarray, float], None]
    up: Callable[[np.ndarray, np.ndarray], None]         # (float32 piece, bits): exact


_KERNELS = {
    "bfloat16": _Kernels(to_bfloat16_bits, sum_bfloat16_rows, from_bfloat16_bits),
    "float16": _Kernels(lambda bits, piece: to_float16(bits.view(np.float16), piece),
                        lambda dst, rows, scale: sum_float16_rows(
                            dst.view(np.float16), rows.view(np.float16), scale),
                        lambda piece, bits: to_float32(piece, bits.view(np.float16))),
}


class WireSum:
    """One float32 piece summed in place over a communicator through ``wire`` ("bfloat16"
    or "float16"), in two collectives: its Alltoallv starts here, its Allgatherv in
    ``start_second`` (a ``flight.InFlight`` orders both alike on every rank)."""

    def __init__(self, communicator: Communicator, piece: np.ndarray, what: What,
                 comm: Optional[MPI.Comm] = None, wire: str = "bfloat16") -> None:
        self.communicator, self.piece, self.what, self.comm = communicator, piece, what, comm
        self.kernels = _KERNELS[wire]
        self.wire = wire
        group = communicator.comm if comm is None else comm
        size, rank = group.Get_size(), group.Get_rank()
        self.spread = float(1 << (size - 1).bit_length())    # 2^m >= size: exact scaling
        self.counts = [hi - lo for lo, hi in (shard_range(piece.size, r, size)
                                              for r in range(size))]
        self.bits = np.empty(piece.size, np.uint16)
        self.kernels.down(self.bits, piece)
        self.shares = np.empty((size, self.counts[rank]), np.uint16)
        self.first = communicator.start_alltoallv(
            self.bits, self.counts, self.shares.reshape(-1), [self.counts[rank]] * size,
            _named(what, wire, "Alltoallv"), comm)
        self.second: Optional[Started] = None

    def test_first(self) -> bool:
        done: bool = self.first.request.Test()
        return done

    def wait_first(self) -> None:
        self.communicator.wait(self.first)

    def start_second(self) -> None:
        """Sum this rank's shares (float32, rank order, one rounding) and gather the sums."""
        mine = np.empty(self.shares.shape[1], np.uint16)
        self.kernels.sum_rows(mine, self.shares, 1.0 / self.spread)
        self.second = self.communicator.start_allgatherv(
            mine, self.counts, self.bits, _named(self.what, self.wire, "Allgatherv"), self.comm)

    def test_second(self) -> bool:
        assert self.second is not None
        if not self.second.request.Test():
            return False
        self._widen()
        return True

    def wait_second(self) -> None:
        assert self.second is not None
        self.communicator.wait(self.second)
        self._widen()

    def _widen(self) -> None:
        """The gathered sums into the piece, as float32, multiplied back (exact)."""
        self.kernels.up(self.piece, self.bits)
        self.piece *= np.float32(self.spread)


def _named(what: What, wire: str, stage: str) -> What:
    def name() -> str:
        text = what() if callable(what) else what
        return f"{text} ({wire} wire: {stage})"
    return name

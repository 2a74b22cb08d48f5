"""The exact reduction of a negotiated call (Reducer(reproducible=True)): its
dense gradients (or an ExactSum's exact sums) summed as integers across the
ranks and rounded once (mpigrad._base.exact has the method); its RowSparse
gradients gathered, as always."""

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .._backends.cross_memory import CrossMemory
from .._base import exact
from .._base.bfloat16 import is_bfloat16
from .._base.dtypes import assign, wire_dtype
from .._base.exact_sum import ExactSum
from .._base.settings import Settings
from .._comm.communicator import Communicator
from .run_order import LaunchOrder
from .negotiate import CallPlan
from .shards import owned
from .sparse import reduce_sparse

__all__ = ["BLOCK", "ExactCall", "ExactScatter", "NAME", "NODE_NAME", "PIECE"]

#: the Reducer's ``backend`` after an exact call
NAME = "exact (integer sums through MPI)"
#: ... after one summed in the node's cross-memory pass (exact.sum_in_one_pass)
NODE_NAME = "exact (float64 sums through cross-memory)"
#: elements summed at a time (bounded memory: a piece's exponents and limbs)
PIECE = 1 << 20
#: float32 elements that agree one pair of exponents (exact.split_blocks)
BLOCK = 32


def _pieces(arrays: List[np.ndarray], start: int, stop: int) -> List[np.ndarray]:
    """Views of the 1-D ``arrays``, taken end to end, that cover [start, stop)."""
    out, offset = [], 0
    for array in arrays:
        lo, hi = max(start - offset, 0), min(stop - offset, array.size)
        if lo < hi:
            out.append(array[lo:hi])
        offset += array.size
    return out


def _cut(arrays: List[np.ndarray], start: int, stop: int) -> np.ndarray:
    """Elements [start, stop) of the 1-D ``arrays`` taken end to end (a view
    where they lie in one array)."""
    pieces = _pieces(arrays, start, stop)
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def _float32_cut(arrays: List[np.ndarray], start: int, stop: int) -> np.ndarray:
    """Elements [start, stop) of the 1-D float32, float16 or bfloat16 ``arrays``
    taken end to end, as float32 (exact casts; a view where they lie in one
    float32 array)."""
    pieces = _pieces(arrays, start, stop)
    if len(pieces) == 1 and pieces[0].dtype == np.float32:
        return pieces[0]
    out, at = np.empty(stop - start, np.float32), 0
    for piece in pieces:
        assign(out[at:at + piece.size], piece)
        at += piece.size
    return out


def _held(arrays: List[np.ndarray], positions: np.ndarray
          ) -> List[Tuple[np.ndarray, np.ndarray]]:
    """(array, its positions) for each of the 1-D ``arrays``, taken end to end,
    that holds some of the sorted ``positions``."""
    held, offset = [], 0
    for array in arrays:
        lo, hi = np.searchsorted(positions, [offset, offset + array.size])
        if lo < hi:
            held.append((array, positions[lo:hi] - offset))
        offset += array.size
    return held


def _blockwise(dtype: np.dtype) -> bool:
    """Whether values of ``dtype`` are summed by float32 blocks (exact in float32)."""
    return dtype == np.float32 or dtype == np.float16 or is_bfloat16(dtype)


def _float64(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(parts, special) of one addend per element: ``values`` in float64 with
    its infinities and NaNs set to 0, as one component, and those alone."""
    finite, special = exact.split_special(values.astype(np.float64))
    return finite[None, :], special


class ExactCall:
    """One exact call: ``mark`` gradients ready (checked only: everything is
    summed in ``finish``), then ``finish``.

    Args:
        call: the call's CallPlan (negotiated as a reduce, or start()).
        comm: the Reducer's Communicator.
        settings: the Reducer's Settings.
        acc: the ExactSum whose sums are reduced (``call`` was negotiated on
            its ``like``), or None: the call's gradients.
        node: the cross-memory sum of a node that holds every rank, or None.
    """

    def __init__(self, call: CallPlan, comm: Communicator, settings: Settings,
                 acc: Optional[ExactSum] = None, node: Optional[CrossMemory] = None) -> None:
        if comm.size >= exact.MAX_TERMS:
            raise ValueError(f"reproducible=True: exact sums take fewer than {exact.MAX_TERMS} "
                             f"ranks, got {comm.size}")
        self.call = call
        self.comm = comm
        self.settings = settings
        self.acc = acc
        self.node = node
        self.summed_by = NAME
        self.measured: Dict[str, float] = {}   # its backend is not measured
        self.finite: Optional[bool] = None
        self.count = len(call.inputs.host)
        # ready()'s checks, as a pipeline's (nothing launches before finish)
        entry = call.entry
        self.order = LaunchOrder(call.runs, entry.bucket_of,
                                 [len(b.indices) for b in entry.plan.buckets], entry.plan.count)

    def mark(self, *indices: int) -> None:
        """Gradients ``indices`` are final (checked; nothing launches before finish)."""
        self.order.mark(indices)

    def launch(self) -> None:
        """Nothing: an exact call sums everything in ``finish``."""

    def finish(self) -> Any:
        """Sum, round and hand back the call's results."""
        call, host, outs = self.call, self.call.inputs.host, self.call.outs
        dense = sorted(call.entry.dense_positions)
        self._sum_into(dense, [outs[i] for i in dense])
        checking = self.settings.check_finite
        finite = not checking or all(bool(np.isfinite(outs[i]).all()) for i in dense)
        if call.entry.plan.sparse:          # gathered: their rows, not summed
            gathered = dataclasses.replace(self.settings, sparse="gather", check_finite=False,
                                           verify=False)
            reduce_sparse(self.comm, call.entry.plan, host, outs, call.divisor, gathered, None)
            finite = finite and all(bool(np.isfinite(outs[i].values).all())
                                    for group in call.entry.plan.sparse for i in group.indices)
        self.finite = finite if checking else None
        return call.inputs.hand_back(outs, call.inplace)

    def _sum_into(self, dense: List[int], outs: List[np.ndarray]) -> None:
        """The exact sums (or means) of the ``dense`` positions, rounded once
        into ``outs`` (mpigrad._base.exact: exponents agreed, limbs summed,
        rounded), a piece of PIECE elements at a time: every buffer is a
        piece's, and a piece needs as many limbs as its own widest element;
        float32, float16 or bfloat16 into their own dtype on one node, in one
        cross-memory pass (_sum_on_node). Denormals count as they are, on a
        thread that flushes them too (exact.gradual_underflow)."""
        with exact.gradual_underflow():
            self._sum_exact(dense, outs)

    def _sum_exact(self, dense: List[int], outs: List[np.ndarray]) -> None:
        host = self.call.inputs.host
        sources = [exact.reals(np.ascontiguousarray(host[i])) for i in dense]
        # written piece by piece: into the results where they are contiguous, else
        # (and for a private call: nothing of the caller's written before every
        # piece is summed) staged and copied at the end
        private = self.call.private and self.call.inplace
        targets = [exact.reals(out) if out.flags.c_contiguous and not private
                   else np.empty(out.size, out.dtype) for out in outs]
        # plain float32 gradients (and half-precision ones, cast exactly to float32):
        # read straight from their bits, one pair of exponents agreed per BLOCK
        # elements and one limb each, the rare blocks wider than a limb summed apart
        float32 = self.acc is None and all(_blockwise(a.dtype) for a in sources)
        accumulated = None if self.acc is None else self._accumulated(dense)
        divisor = self.call.divisor
        total = sum(a.size for a in sources)                # the same on every rank
        if self.node is not None and float32 and all(
                a.dtype == t.dtype for a, t in zip(sources, targets)):
            self._sum_on_node(sources, targets)
        else:
            for start in range(0, total, PIECE):
                stop = min(total, start + PIECE)
                into = _pieces(targets, start, stop)
                if not float32:
                    self._sum_exactly(*(_float64(_cut(sources, start, stop))
                                        if accumulated is None
                                        else (accumulated[0][:, start:stop],
                                              accumulated[1][start:stop])),
                                      into, divisor)
                    continue
                values = _float32_cut(sources, start, stop)
                blocks = exact.exponents_float32(values, BLOCK)
                self.comm.allreduce_pieces(blocks, "max",
                                           "Allreduce of the exact sums' exponents")
                pairs, apart = exact.split_blocks(blocks, BLOCK, values.size)
                limbs = exact.to_limb_float32(values, pairs)
                wide = _float64(values[apart])      # read before in place results land
                self.comm.allreduce_pieces(limbs.reshape(-1), "sum",
                                           "Allreduce of the exact sums")
                exact.write_float32(into, limbs, pairs, divisor)
                if apart.size:                      # the same on every rank
                    held = _held(into, apart)       # each rounded once to its own dtype
                    summed = [np.empty(at.size, array.dtype) for array, at in held]
                    self._sum_exactly(*wide, summed, divisor)
                    for (array, at), values_apart in zip(held, summed):
                        array[at] = values_apart
        if self.settings.verify:
            self.comm.verify_same(targets, "exact sums")
        for out, target in zip(outs, targets):
            if not np.shares_memory(out, target):
                out[...] = target.view(out.dtype).reshape(out.shape)

    def _sum_on_node(self, sources: List[np.ndarray], targets: List[np.ndarray]) -> None:
        """The exact sums of the ``sources`` (float32, float16 or bfloat16) into
        the ``targets`` of their dtypes through the node's cross-memory pass,
        which holds every rank: each rank reads its slice of every array out of
        its peers' memory and sums it (exact.sum_in_one_pass: in float64 where
        a run of values fits one limb, else element by element), then writes it
        into theirs. Nothing crosses MPI but the addresses and the end's
        agreement."""
        assert self.node is not None
        divisor = self.call.divisor
        self.node.combine(list(zip(targets, sources)),
                          lambda addends, into: exact.sum_in_one_pass(into, addends, divisor),
                          "exact sum (cross-memory)", lasting=self.call.inplace)
        self.summed_by = NODE_NAME

    def _sum_exactly(self, parts: np.ndarray, special: np.ndarray, into: List[np.ndarray],
                     divisor: int) -> None:
        """The elements of the expansion ``parts`` (``special``: their
        non-finite addends) summed across the ranks, each in units of its own
        agreed lowest bit, in as many limbs as the widest needs, divided by
        ``divisor`` and rounded once into the 1-D ``into`` (taken end to end)."""
        agreed = exact.exponents(parts, special)
        self.comm.allreduce_pieces(agreed, "max", "Allreduce of the exact sums' exponents")
        words, odd = exact.layout(agreed)
        limbs = exact.to_limbs(parts, agreed, words)
        self.comm.allreduce_pieces(limbs.reshape(-1), "sum", "Allreduce of the exact sums")
        if odd:                                 # the same on every rank
            self.comm.allreduce_pieces(special, "sum", "Allreduce of the non-finite addends")
        exact.write_results(into, limbs, agreed, special if odd else None, divisor)

    def _accumulated(self, dense: List[int]) -> Tuple[np.ndarray, np.ndarray]:
        """The ExactSum's (parts, special) of the ``dense`` positions."""
        assert self.acc is not None
        parts, special = self.acc.components()
        if len(dense) == self.count:
            return parts, special
        sizes = [exact.size_of([(a.shape, a.dtype)]) for a in self.call.inputs.host]
        starts = np.cumsum([0] + sizes)
        keep = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in dense]
                              or [np.zeros(0, np.int64)])
        return parts[:, keep], special[keep]


class ExactScatter(ExactCall):
    """A reduce-scatter with reproducible=True (negotiated as one, without an
    ExactSum): every dense gradient's exact sum (or mean), rounded once to its
    wire dtype, of which this rank keeps its shard ({wire dtype: 1-D array},
    the elements ``owned`` gives it; written into ``into``'s array of that
    dtype where given). Every rank gets the whole sum, not 1/p of it."""

    def __init__(self, call: CallPlan, comm: Communicator, settings: Settings,
                 into: Optional[Dict[np.dtype, np.ndarray]] = None,
                 node: Optional[CrossMemory] = None) -> None:
        super().__init__(call, comm, settings, node=node)
        self.into = into or {}

    def finish(self) -> Dict[np.dtype, np.ndarray]:
        """This rank's shards of the exact sums."""
        call = self.call
        host = call.inputs.host
        dense = sorted(call.entry.dense_positions)
        sums = {i: np.empty(host[i].shape, wire_dtype(host[i].dtype)) for i in dense}
        self._sum_into(dense, [sums[i] for i in dense])
        if self.settings.check_finite:         # every rank holds every sum: agreed
            self.finite = all(bool(np.isfinite(a).all()) for a in sums.values())
        shards = owned(call.entry.plan, self.comm.rank, self.comm.size)
        out = {}
        for dtype, ranges in shards.items():
            shard = np.concatenate([sums[i].reshape(-1)[first:stop]
                                    for i, first, stop in ranges] or [np.zeros(0, dtype)])
            if dtype in self.into:
                self.into[dtype][...] = shard
                shard = self.into[dtype]
            out[dtype] = shard
        return out

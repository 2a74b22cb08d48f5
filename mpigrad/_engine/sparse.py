"""The reduction of row-sparse gradients: by Allgatherv of their rows, or
dense (densified and allreduced) where that moves fewer bytes."""

import math
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from .._base.row_sparse import RowSparse, scatter_add
from .._base.settings import Settings
from .._comm.communicator import Communicator, Started
from .plan import FusionPlan
from .settle import Settle, all_finite, mean_factor
from .settle import scale as scale_by

__all__ = ["gather_is_cheaper", "gather_rows", "start_gather_rows", "reduce_sparse",
           "reduce_sparse_group"]


def gather_is_cheaper(total_rows: int, dense_shape: Tuple[int, ...], wire: np.dtype,
                      size: int) -> bool:
    """Whether gathering ``total_rows`` rows moves fewer bytes than an allreduce.

    A gather receives every rank's rows and indices; a ring or
    reduce-scatter allreduce of N bytes moves 2 (p-1)/p N per rank.
    """
    row_bytes = math.prod(dense_shape[1:]) * wire.itemsize
    gather = total_rows * (row_bytes + 8)
    dense = 2 * (size - 1) / size * dense_shape[0] * row_bytes
    return gather <= dense


def reduce_sparse(comm: Communicator, plan: FusionPlan, grads: List[Any], outs: List[Any],
                  divisor: int, settings: Settings, settle: Optional[Settle]) -> None:
    """Reduce the RowSparse gradients of ``plan`` into ``outs``: one counts
    exchange for all of them, then one fused reduction per wire dtype; the
    mean's ``divisor`` (1: a sum), the finite flag into
    ``settle`` (the call's Settle; None without check_finite)."""
    order = [i for group in plan.sparse for i in group.indices]
    counts = comm.allgather_counts([grads[i].nnz for i in order])
    column = 0
    for group in plan.sparse:
        n = len(group.indices)
        results = reduce_sparse_group(
            comm, [grads[i] for i in group.indices], counts[:, column:column + n],
            group.dtype, mean_factor(group.dtype, divisor), settings.sparse)
        for index, result in zip(group.indices, results):
            outs[index] = result
            if settle is not None and settings.check_finite:   # values cast back: inf shows
                settle.note(all_finite(result.values))
        column += n
    if settings.verify:
        comm.verify_same([a for i in order for a in (outs[i].indices, outs[i].values)],
                         "reduced sparse gradients")


def reduce_sparse_group(comm: Communicator, items: List[RowSparse], counts: np.ndarray,
                        wire: np.dtype, scale: Any, mode: str) -> List[RowSparse]:
    """Reduce the RowSparse ``items`` (one wire dtype) across ranks.

    ``counts`` is the (ranks, len(items)) matrix of every rank's row counts,
    from one exchange. One Allgatherv carries all indices; one carries the
    values of the gradients that are gathered; the others are densified and
    allreduced. Returns new RowSparse objects of the inputs' dtypes.
    """
    size = comm.size
    totals = counts.sum(axis=0)
    gather = [mode == "gather" or (mode == "auto" and gather_is_cheaper(
        int(t), it.dense_shape, wire, size)) for it, t in zip(items, totals)]
    widths = [math.prod(it.dense_shape[1:]) for it in items]
    all_indices = gather_rows(comm, [it.indices for it in items], counts,
                                [1] * len(items), np.dtype(np.int64))
    chosen = [j for j, g in enumerate(gather) if g]
    gathered = dict(zip(chosen, gather_rows(
        comm, [items[j].values for j in chosen], counts[:, chosen],
        [widths[j] for j in chosen], wire)))
    out = []
    for j, item in enumerate(items):
        rows = all_indices[j].reshape(-1)
        if gather[j]:
            values = gathered[j].reshape(rows.shape[0], *item.dense_shape[1:])
        else:
            dense = scatter_add(item.indices, item.values, item.dense_shape)
            comm.allreduce_sum(dense.reshape(-1))
            rows = np.unique(rows)
            values = dense[rows]
        if scale is not None:
            values = np.array(values, dtype=wire)     # a contiguous copy, scaled in place
            scale_by(values, scale)
        out.append(RowSparse(rows.astype(item.indices.dtype),
                             values.astype(item.dtype), item.dense_shape))
    return out


def gather_rows(comm: Communicator, arrays: List[np.ndarray], counts: np.ndarray,
                  widths: List[int], wire: np.dtype) -> List[np.ndarray]:
    """The one row gather: every rank's rows of several arrays, in one
    Allgatherv (RowSparse gradients here, the collective layer's row
    gathers for every face: sparse tensors, Horovod's allgather).

    ``counts`` is the (ranks, len(arrays)) matrix of every rank's row counts
    (exchanged before), ``widths`` each array's elements per row. Rank r
    sends its arrays' rows back to back, cast to ``wire``; the result is,
    per array, every rank's rows in rank order, as a (total_rows, width)
    ``wire`` array.
    """
    started, finish = start_gather_rows(comm, arrays, counts, widths, wire)
    if started is not None:
        comm.wait(started)
    return finish()


def start_gather_rows(comm: Communicator, arrays: List[np.ndarray], counts: np.ndarray,
                      widths: List[int], wire: np.dtype
                      ) -> Tuple[Optional[Started], Callable[[], List[np.ndarray]]]:
    """``gather_rows`` started: its Allgatherv (None where nothing moves), and
    what makes its result once that has completed."""
    if not arrays:
        return None, list
    per_rank = counts @ np.asarray(widths, dtype=np.int64)     # elements each rank sends
    send = np.empty(int(per_rank[comm.rank]), wire)
    offset = 0
    for array, width in zip(arrays, widths):
        n = array.shape[0] * int(width)
        np.copyto(send[offset:offset + n], array.reshape(-1), casting="unsafe")
        offset += n
    recv = np.empty(int(per_rank.sum()), wire)
    started = comm.start_allgatherv(send, per_rank, recv, "Allgatherv of rows") \
        if recv.size else None
    return started, lambda: _split_rows(recv, counts, widths, wire)


def _split_rows(recv: np.ndarray, counts: np.ndarray, widths: List[int],
                wire: np.dtype) -> List[np.ndarray]:
    """Every rank's rows of each array, out of what ``start_gather_rows`` received."""
    out = [np.empty((int(counts[:, j].sum()), int(w)), wire) for j, w in enumerate(widths)]
    filled = [0] * len(widths)
    offset = 0
    for r in range(counts.shape[0]):
        for j, width in enumerate(widths):
            n = int(counts[r, j])
            out[j][filled[j]:filled[j] + n] = recv[offset:offset + n * width].reshape(n, width)
            filled[j] += n
            offset += n * int(width)
    return out

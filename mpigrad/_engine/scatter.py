"""Reduce-scatter and allgather of the fused gradient space (shards.py):
the two halves of a sharded optimizer step.

``reduce_scatter`` packs a call's dense gradients into one arena per wire
dtype (private staging memory kept with the plan: bucket views handed out
are never written), sums each
arena so that every rank receives only its shard (on one node, through
cross-memory attach: the node sum without its push; else MPI's
reduce-scatter),
and settles the shard (the mean, and with check_finite the finite flag,
agreed over the ranks). ``allgather`` gathers every rank's shard of each
arena and unpacks the arenas into the caller's arrays, casting back to half
precision where the gradients are. Both run on a CallPlan from the one
negotiation (structure, settings and local errors checked on every rank).
"""

from typing import Any, Dict, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .buffers import arena_sizes
from .settle import Settle
from .shards import shard_range

__all__ = ["reduce_scatter", "allgather", "check_shards"]


def _counts(n, size):
    return [hi - lo for lo, hi in (shard_range(n, r, size) for r in range(size))]


def reduce_scatter(call: Any, comm: Any, settings: Any, node: Any = None
                   ) -> Tuple[Dict[np.dtype, np.ndarray], Optional[bool]]:
    """({wire dtype: this rank's shard of the mean (or sum)}, the finite flag
    or None) of the CallPlan ``call``; summed through ``node``, the
    cross-memory backend of a node holding every rank, or MPI (None)."""
    entry, grads = call.entry, call.inputs.host
    buffers, buckets = entry.buffers, entry.plan.buckets
    arenas = buffers.staging()
    for i, (bucket, start) in enumerate(zip(buckets, buffers.starts)):
        buffers.pack_into(i, grads, arenas[bucket.dtype][start:start + bucket.size])
    settle = Settle([b.dtype for b in buckets], buffers.starts, [b.size for b in buckets],
                    entry.limits if settings.check_finite else None, call.degree, settings.mean)
    shards = {}
    with np.errstate(all="ignore"):      # nan and inf propagate, as in the trainer
        for dtype, arena in arenas.items():
            if node is not None:
                shards[dtype] = node.scatter_sum(
                    arena, lambda first, piece, d=dtype: settle.piece(d, first, piece)).copy()
                continue
            lo, hi = shard_range(arena.size, comm.rank, comm.size)
            shard = np.empty(hi - lo, dtype)
            comm.reduce_scatter_sum(arena, shard, _counts(arena.size, comm.size),
                                    f"Reduce_scatter of the {dtype.name} gradients "
                                    f"({arena.nbytes} bytes)")
            settle.piece(dtype, lo, shard)
            shards[dtype] = shard
    if settle.finite is not None:        # each rank checked its shard: agreed
        flag = np.array([1 if settle.finite else 0], np.int64)
        comm.allreduce(flag, MPI.MIN, "finite flag of the shards")
        settle.finite = bool(flag[0])
    return shards, settle.finite


def check_shards(entry: Any, shards: Any, rank: int, size: int) -> None:
    """Raise unless ``shards`` is {wire dtype: this rank's 1-D shard} of
    ``entry``'s plan (as ``reduce_scatter`` returns)."""
    sizes = arena_sizes(entry.plan.buckets)
    if not isinstance(shards, dict) or set(map(np.dtype, shards)) != set(sizes):
        got = sorted(map(str, shards)) if isinstance(shards, dict) else type(shards).__name__
        raise ValueError(f"shards: expecting a dict of the wire dtypes "
                         f"{sorted(d.name for d in sizes)} (as reduce_scatter returns), got {got}")
    for dtype, shard in shards.items():
        lo, hi = shard_range(sizes[np.dtype(dtype)], rank, size)
        if (not isinstance(shard, np.ndarray) or shard.dtype != np.dtype(dtype)
                or shard.shape != (hi - lo,)):
            got = (f"{shard.dtype}{list(shard.shape)}" if isinstance(shard, np.ndarray)
                   else type(shard).__name__)
            raise ValueError(f"shards[{np.dtype(dtype).name}]: expecting this rank's "
                             f"{np.dtype(dtype).name}[{hi - lo}], got {got}")


def allgather(call: Any, comm: Any, shards: Dict[Any, np.ndarray], node: Any = None) -> Any:
    """Gather every rank's ``shards`` (checked: ``check_shards``) into the
    call's arrays (read out of the peers' memory through ``node``, as for
    ``reduce_scatter``, or MPI); return them as the caller gave them."""
    entry, outs = call.entry, call.inputs.host
    buffers, buckets = entry.buffers, entry.plan.buckets
    arenas = dict(buffers.staging())
    for dtype, shard in shards.items():
        dtype = np.dtype(dtype)
        n = arena_sizes(buckets)[dtype]
        if node is not None:
            node.gather(np.ascontiguousarray(shard), arenas[dtype])
            continue
        arenas[dtype] = comm.allgatherv(np.ascontiguousarray(shard), _counts(n, comm.size),
                                        f"Allgatherv of the {dtype.name} shards ({n} elements)")
    for i, (bucket, start) in enumerate(zip(buckets, buffers.starts)):
        buffers.unpack_from(i, arenas[bucket.dtype][start:start + bucket.size], outs)
    return call.inputs.hand_back(outs, inplace=True)

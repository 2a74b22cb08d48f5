"""Reduce-scatter and allgather of the fused gradient space (shards.py):
the two halves of a sharded optimizer step.

``ScatterCall`` sums each wire dtype's arena (its gradients side by side,
in plan order) so that every rank receives only its shard, and settles the
shard (the mean, and with check_finite the finite flag, agreed over the
ranks). ``allgather`` gathers every rank's shard into the caller's arrays,
casting back to half precision where they are. Both run on a CallPlan from
the one negotiation (structure, settings and local errors checked on every
rank).

On one node holding every rank, through cross-memory attach, the arena is
the caller's own arrays wherever they are in the wire dtype and C order:
each rank reads its slice of every peer's gradients out of them, and reads
every peer's shard straight into its own parameters; only the others are
packed into (and unpacked from) private staging. Through MPI, every gradient
is packed into the staging arena for Reduce_scatter / Allgatherv.
"""

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .buffers import arena_sizes
from .._base.dtypes import assign
from .launch import LaunchOrder
from .settle import Settle
from .._base.ranges import shard_range

__all__ = ["ScatterCall", "allgather", "check_shards"]


def _counts(n, size):
    return [hi - lo for lo, hi in (shard_range(n, r, size) for r in range(size))]


def _slots(buffers, dtype):
    """(position, arena slot [start, stop), shape) of every gradient of the
    buckets of wire dtype ``dtype``, in arena order."""
    for bucket, start, slots in zip(buffers.plan.buckets, buffers.starts, buffers.slots):
        if bucket.dtype == dtype:
            for index, lo, hi, shape in slots:
                yield index, start + lo, start + hi, shape


def _as_is(array, dtype, writes):
    """``array`` as 1-D memory of the arena if it can be read (and with
    ``writes`` written) as it is: the wire dtype, C order; else None."""
    if array.dtype != dtype or not array.flags.c_contiguous or (writes
                                                                and not array.flags.writeable):
        return None
    return array.reshape(-1)


def _parts(buffers, arrays, dtype, arena, writes):
    """(the arena of wire dtype ``dtype`` as 1-D parts: ``arrays``' own memory
    where it can serve as is, else its slot of the staging ``arena``; the
    (array position, slot) pairs that went through staging)."""
    parts, staged = [], []
    for index, lo, hi, shape in _slots(buffers, dtype):
        own = _as_is(arrays[index], dtype, writes)
        if own is None:
            own = arena[lo:hi]
            staged.append((index, own.reshape(shape)))
        parts.append(own)
    return parts, staged


class ScatterCall:
    """One reduce-scatter in flight: ``mark`` gradients ready (overlap with
    backward), then ``finish`` for the shards.

    Through MPI, each message run of the call (in launch order, as its
    buckets complete) is packed into the staging arena and goes out as one
    Ireduce_scatter of that span of the arena, of which every rank receives
    the part that falls in its shard, straight into place. Through
    cross-memory (``node``), everything is summed in ``finish``.

    Args:
        call: the CallPlan (a reduce-scatter kind).
        comm: the Reducer's Communicator.
        settings: the Reducer's Settings.
        node: the cross-memory backend of a node holding every rank, or None.
    """

    def __init__(self, call: Any, comm: Any, settings: Any, node: Any = None) -> None:
        entry = call.entry
        self.call, self.comm, self.node = call, comm, node
        self.grads = call.inputs.host
        self.buffers = entry.buffers
        buckets = entry.plan.buckets
        self.settle = Settle([b.dtype for b in buckets], self.buffers.starts,
                             [b.size for b in buckets],
                             entry.limits if settings.check_finite else None, call.degree,
                             settings.mean)
        self.order = LaunchOrder(call.runs, entry.bucket_of, [len(b.indices) for b in buckets],
                                 entry.plan.count)
        self.arenas = self.buffers.staging()
        self.ranges = {dtype: shard_range(arena.size, comm.rank, comm.size)
                       for dtype, arena in self.arenas.items()}
        self.shards = {dtype: self.buffers.shard(dtype, hi - lo)
                       for dtype, (lo, hi) in self.ranges.items()}
        self.requests: List[Tuple[Any, str]] = []

    def mark(self, *indices: int) -> None:
        """Gradients ``indices`` are final: launch every run that became complete."""
        self.order.mark(indices)
        if self.node is None:
            self._launch(self.order.due())

    def _launch(self, runs: List[Tuple[int, int]]) -> None:
        buckets, starts = self.call.entry.plan.buckets, self.buffers.starts
        for first, last in runs:
            dtype = buckets[first].dtype
            arena, (lo, hi) = self.arenas[dtype], self.ranges[dtype]
            for i in range(first, last + 1):
                self.buffers.pack_into(i, self.grads,
                                       arena[starts[i]:starts[i] + buckets[i].size])
            start, stop = starts[first], starts[last] + buckets[last].size
            counts = [max(0, min(stop, b) - max(start, a))
                      for a, b in (shard_range(arena.size, r, self.comm.size)
                                   for r in range(self.comm.size))]
            into = self.shards[dtype][max(start, lo) - lo:max(min(stop, hi), lo) - lo]
            self.requests.append(self.comm.start_reduce_scatter_sum(
                arena[start:stop], into, counts,
                f"Reduce_scatter of {dtype.name} buckets {first}-{last} "
                f"({(stop - start) * dtype.itemsize} bytes)"))

    def finish(self) -> Tuple[Dict[np.dtype, np.ndarray], Optional[bool]]:
        """({wire dtype: this rank's shard of the mean (or sum)}, the finite
        flag or None): what is left summed, every shard settled."""
        settle, comm = self.settle, self.comm
        with np.errstate(all="ignore"):      # nan and inf propagate, as in the trainer
            if self.node is not None:
                self._sum_on_node()
            else:
                self._launch(self.order.due(complete_only=False))
                for started in self.requests:
                    comm.wait(started)
                for dtype, shard in self.shards.items():
                    settle.piece(dtype, self.ranges[dtype][0], shard)
        if settle.finite is not None:        # each rank checked its shard: agreed
            flag = np.array([1 if settle.finite else 0], np.int64)
            comm.allreduce(flag, "min", "finite flag of the shards")
            settle.finite = bool(flag[0])
        return self.shards, settle.finite

    def _sum_on_node(self) -> None:
        """Every arena summed through cross-memory, read out of the
        gradients where they can be read as they are."""
        for dtype, arena in self.arenas.items():
            parts, staged = _parts(self.buffers, self.grads, dtype, arena, writes=False)
            for index, slot in staged:
                assign(slot, self.grads[index])
            self.node.scatter_sum(
                parts, lambda first, piece, d=dtype: self.settle.piece(d, first, piece),
                self.shards[dtype])


def check_shards(entry: Any, shards: Any, rank: int, size: int) -> None:
    """Raise unless ``shards`` is {wire dtype: this rank's 1-D shard} of
    ``entry``'s plan (as ``reduce_scatter`` returns), or None."""
    if shards is None:
        return
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


def allgather(call: Any, comm: Any, shards: Optional[Dict[Any, np.ndarray]],
              node: Any = None) -> Any:
    """Gather every rank's ``shards`` (checked: ``check_shards``; None: each
    rank's shard is already in its arrays) into the call's arrays (read out
    of the peers' memory through ``node``, as for ``reduce_scatter``, or
    MPI); return them as the caller gave them."""
    entry, outs = call.entry, call.inputs.host
    buffers = entry.buffers
    for dtype, arena in buffers.staging().items():
        n = arena.size
        shard = None if shards is None else np.ascontiguousarray(shards[dtype])
        if node is not None:
            parts, staged = _parts(buffers, outs, dtype, arena, writes=True)
            if shard is None:        # the staged arrays' own slices, where the peers read
                for index, slot in staged:
                    assign(slot, outs[index])
            node.gather(parts, shard)
            _unstage(staged, outs)
            continue
        if shard is None:        # this rank's elements, out of its arrays
            lo, hi = shard_range(n, comm.rank, comm.size)
            for index, start, stop, _ in _slots(buffers, dtype):
                first, last = max(lo, start), min(hi, stop)
                if first < last:
                    assign(arena[first:last], np.ravel(outs[index])[first - start:last - start])
            shard = arena[lo:hi].copy()
        whole = comm.allgatherv(shard, _counts(n, comm.size),
                                f"Allgatherv of the {dtype.name} shards ({n} elements)", arena)
        _unstage([(index, whole[start:stop].reshape(shape))
                  for index, start, stop, shape in _slots(buffers, dtype)], outs)
    return call.inputs.hand_back(outs, inplace=True)


def _unstage(staged: List[Tuple[int, np.ndarray]], outs: List[Any]) -> None:
    """Write the staged slots into their arrays, casting back."""
    for index, slot in staged:
        assign(outs[index], slot)

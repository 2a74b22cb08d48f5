"""Reduce-scatter and allgather of the fused gradient space (shards.py):
the two halves of a sharded optimizer step.

``ScatterCall`` sums each wire dtype's arena (its gradients side by side,
in plan order) so that every rank receives only its shard, and settles the
shard (the mean, and with check_finite the finite flag, agreed over the
ranks). ``allgather`` gathers every rank's shard into the caller's arrays,
casting back to half precision where they are. Both run on a CallPlan from
the one negotiation (structure, settings and local errors checked on every
rank), and move their data through a shard backend (mpigrad._backends):
MPI, whose runs of packed buckets go out as backward completes them, or,
on one node holding every rank, cross-memory attach, which reads the
caller's own arrays where they are in the wire dtype and C order.
"""

from typing import Any, Dict, Optional

import numpy as np

from .._backends import ShardBackend
from .._base.arena import Arena
from .._base.ranges import shard_range
from .._comm.communicator import Communicator
from .buffers import BucketBuffers, arena_sizes
from .run_order import LaunchOrder
from .negotiate import CallPlan
from .settle import Settle

__all__ = ["ScatterCall", "allgather", "check_shards"]

Shards = Dict[np.dtype, np.ndarray]


def arenas_of(buffers: BucketBuffers, arrays: Any) -> Dict[np.dtype, Arena]:
    """Each wire dtype's arena of ``arrays`` (the call's host arrays), staged
    in the buffers' private staging memory."""
    staging = buffers.staging()
    return {dtype: Arena(dtype, buffers.arena_slots(dtype), arrays, memory)
            for dtype, memory in staging.items()}


class ScatterCall:
    """One reduce-scatter in flight: ``mark`` gradients ready (overlap with
    backward), then ``finish`` for the shards.

    With an incremental backend (MPI), each message run of the call (in
    launch order, as its buckets complete) is packed into the staging arena
    and submitted; otherwise everything is summed in ``finish``.

    Args:
        call: the CallPlan (a reduce-scatter kind).
        comm: the Reducer's Communicator.
        check_finite: the Reducer's setting.
        backend: the Reducer's shard backend.
        into: where a wire dtype's shard is written (a 1-D array of its
            dtype and size: a caller's output); default the buffers' own.
    """

    def __init__(self, call: CallPlan, comm: Communicator, check_finite: bool,
                 backend: ShardBackend, into: Optional[Shards] = None) -> None:
        entry = call.entry
        self.call, self.comm, self.backend = call, comm, backend
        self.summed_by: str = backend.name
        self.measured: Dict[str, float] = {}   # its backend is not measured
        self.grads = call.inputs.host
        self.buffers = entry.buffers
        buckets = entry.plan.buckets
        self.settle = Settle([b.dtype for b in buckets], self.buffers.starts,
                             [b.size for b in buckets],
                             entry.limits if check_finite else None, call.divisor)
        self.order = LaunchOrder(call.runs, entry.bucket_of, [len(b.indices) for b in buckets],
                                 entry.plan.count)
        self.arenas = arenas_of(self.buffers, self.grads)
        given = into or {}
        self.shards = {dtype: given[dtype] if dtype in given else
                       self.buffers.shard(dtype, hi - lo) for dtype, (lo, hi) in (
                           (dtype, shard_range(arena.size, comm.rank, comm.size))
                           for dtype, arena in self.arenas.items())}
        self.scattering = backend.scatter(self.arenas, self.shards)
        self.finite: Optional[bool] = None

    def mark(self, *indices: int) -> None:
        """Gradients ``indices`` are final (checked; local)."""
        self.order.mark(indices)

    def launch(self) -> None:
        """Launch every run that became complete."""
        self._launch(complete_only=True)

    def _launch(self, complete_only: bool) -> None:
        if not self.backend.incremental:
            return
        buckets, starts = self.call.entry.plan.buckets, self.buffers.starts
        for first, last in self.order.due(complete_only):
            arena = self.arenas[buckets[first].dtype]
            for i in range(first, last + 1):
                self.buffers.pack_into(i, self.grads,
                                       arena.staging[starts[i]:starts[i] + buckets[i].size])
            self.scattering.submit(arena, starts[first], starts[last] + buckets[last].size)

    def finish(self) -> Shards:
        """{wire dtype: this rank's shard of the mean (or sum)}: what is left
        summed, every shard settled; ``finite`` set (agreed over the ranks)."""
        settle = self.settle
        with np.errstate(all="ignore"):      # nan and inf propagate, as in the trainer
            self._launch(complete_only=False)
            self.scattering.complete(settle)
        if settle.finite is not None:        # each rank checked its shard: agreed
            flag = np.array([1 if settle.finite else 0], np.int64)
            self.comm.allreduce(flag, "min", "finite flag of the shards")
            settle.finite = bool(flag[0])
        self.finite = settle.finite
        return self.shards


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


def allgather(call: CallPlan, shards: Optional[Shards], backend: ShardBackend) -> Any:
    """Gather every rank's ``shards`` (checked: ``check_shards``; None: each
    rank's shard is already in its arrays) into the call's arrays through
    ``backend``; return them as the caller gave them."""
    outs = call.inputs.host
    for dtype, arena in arenas_of(call.entry.buffers, outs).items():
        backend.gather(arena, None if shards is None else np.ascontiguousarray(shards[dtype]))
    return call.inputs.hand_back(outs, inplace=True)

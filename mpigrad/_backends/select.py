"""Which backends a Reducer has (decided once, collectively, at construction)
and which one sums each call (decided from what the ranks agreed on)."""

import logging
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import numpy as np

from .._base import exact
from .._base.settings import Settings
from .._comm.communicator import Communicator
from . import ShardBackend, SumBackend
from .cross_memory import CrossMemory, OverlappedCrossMemory, cross_memory_problem
from .mpi import MpiBackend, MpiShards
from .node_groups import NodeGroups
from .node_memory import SEGMENT_DIR, SharedBuckets, remove_orphans, shared_memory_problem

__all__ = ["Backends", "CallTraits", "select"]

_log = logging.getLogger("mpigrad")


@dataclass(frozen=True)
class CallTraits:
    """What decides where a call is summed, agreed by every rank."""

    blocking: bool        # reduce() (not start(), bucket_views() or the shards)
    inplace: bool         # results written into the caller's arrays
    zero_copy: bool       # some rank holds some bucket as its views
    packed: bool          # some rank packs some bucket
    views_given: bool     # some rank handed out the plan's bucket views
    own_memory: bool = False   # in place, some rank sums a bucket in its gradient's memory


@dataclass(frozen=True)
class Backends:
    """A Reducer's backends.

    Attributes:
        mpi: MPI's Allreduce (always there).
        groups: the node structure where node sums are on, else None.
        cross: the cross-memory sum where it can be had, else None.
        overlapped: across nodes, the cross-memory sum of overlapped calls
            (each run's node sum as it comes, its way across the nodes behind
            backward), else None.
        shards: what moves reduce-scatter shards: cross-memory on one node
            holding every rank (its slices are the shards), else MPI.
        shared_memory: the Reducer's setting ("auto", True or False).
        measured: whether the fastest of cross-memory, MPI (and node memory,
            for in-place calls that pack every bucket) is measured per plan
            (cross_memory="auto"; ``alternatives``).
        exact_node: with reproducible=True (then the float sums' node backends
            are off), the cross-memory pass of the exact sums where one node
            holds every rank, else None.
    """

    mpi: MpiBackend
    groups: Optional[NodeGroups]
    cross: Optional[CrossMemory]
    overlapped: Optional[OverlappedCrossMemory]
    shards: ShardBackend
    shared_memory: Union[str, bool]
    measured: bool
    exact_node: Optional[CrossMemory] = None

    def sets_up_node_memory(self, bucket_views: bool, sharded: bool,
                            packs_in_place: bool = False) -> bool:
        """Whether a plan's first call of this kind moves its buckets into
        node memory: not for the shards; with cross-memory sums (and
        shared_memory="auto"), only for bucket_views, and for an in-place
        call that packs every bucket where the choice is measured (node
        memory is then one of the candidates: ``alternatives``)."""
        return (self.groups is not None and not sharded
                and (self.cross is None or bucket_views
                     or (packs_in_place and self.measured)))

    def share(self, sizes: Dict[np.dtype, int]) -> Optional[SharedBuckets]:
        """Node memory for a plan's buckets of ``sizes`` (collective over the
        node), or None where it could not be made ("auto": that plan then
        goes through MPI); an error where shared_memory=True."""
        assert self.groups is not None
        shared = SharedBuckets(self.groups, sizes)
        if shared.failure is None:
            return shared
        if self.shared_memory is True:        # (every rank knows every rank's failure)
            self.groups.communicator.raise_agreed(RuntimeError(
                f"shared_memory=True: node memory for the buckets could not be made "
                f"({shared.failure}); free space in {SEGMENT_DIR} or use shared_memory='auto'"))
        _log.debug("shared memory: %s; this plan uses MPI's Allreduce", shared.failure)
        return None

    def for_call(self, shared: Optional[SharedBuckets], call: CallTraits) -> SumBackend:
        """What sums a call whose buckets live in ``shared`` (None: private
        memory). Node memory: never into zero-copy views that a plain reduce
        must leave alone; always otherwise with shared_memory=True; with
        "auto", calls zero-copy on every rank, plain reduces of plans whose
        bucket views no rank handed out (it packs into the node memory they
        live in), and packed in-place calls where packing pays
        (NodeGroups.packing_pays). Cross-memory: blocking calls, unless every
        rank sums in its views in node memory; across nodes, overlapped calls
        too (the hierarchy and the overlap: the link is the bottleneck there).
        Else MPI."""
        if self.overlapped is not None and not call.blocking:
            return self.overlapped
        node = shared is not None and self._node_sum_pays(call)
        if self.cross is not None and call.blocking and not (
                node and call.inplace and call.zero_copy and not call.packed):
            return self.cross
        if node:
            assert shared is not None
            return shared
        return self.mpi

    def alternatives(self, backend: SumBackend, call: CallTraits,
                     shared: Optional[SharedBuckets]) -> Tuple[SumBackend, ...]:
        """The backends measured against ``backend`` (from ``for_call``) for a
        plan's calls like ``call`` (none: nothing measured), with
        cross_memory="auto": MPI's Allreduce against the cross-memory sum of
        blocking calls in private memory (which one wins depends on the
        machine and the library), and node memory too where the plan's
        buckets are there and an in-place call packs every one of them (no
        gradient summed where it lies: 1000 arrays of 256 float32 in place,
        kept in node memory, 1.04-1.36 ms a call against 1.33-2.04 with the
        other two alone, MPICH, 2 ranks; ResNet-50's in place, whose large
        gradients are summed in their own memory, is no candidate)."""
        if not (self.measured and backend is self.cross and call.blocking
                and not call.zero_copy):
            return ()
        if shared is not None and call.inplace and not call.own_memory:
            return self.mpi, shared
        return (self.mpi,)

    def _node_sum_pays(self, call: CallTraits) -> bool:
        allowed = call.inplace or not call.zero_copy
        if self.shared_memory is True:
            return allowed
        if not call.inplace:
            return allowed and not call.views_given
        assert self.groups is not None
        return self.groups.packing_pays or not call.packed


def select(communicator: Communicator, settings: Settings) -> Backends:
    """The backends of a Reducer over ``communicator`` (collective: the node
    structure and what every local rank can do are agreed); an error on
    every rank where shared_memory=True or cross_memory=True cannot be had."""
    groups = _node_groups(communicator, settings)
    cross = _cross_memory(settings, groups)
    mpi = MpiBackend(communicator)
    if settings.reproducible:      # every sum exact: the node only in the exact one's pass
        return Backends(mpi, None, None, None, MpiShards(communicator), False, measured=False,
                        exact_node=_exact_node(cross))
    shards: ShardBackend = cross if cross is not None and cross.whole \
        else MpiShards(communicator)
    overlapped = None if cross is None or cross.groups.nodes == 1 else \
        OverlappedCrossMemory(cross)
    return Backends(mpi, groups, cross, overlapped, shards, settings.shared_memory,
                    measured=settings.cross_memory == "auto")


def _exact_node(cross: Optional[CrossMemory]) -> Optional[CrossMemory]:
    """``cross`` where its node holds every rank and every rank can sum exactly in
    one pass (its C kernels, at most FLOAT64_TERMS local ranks: agreed), else None."""
    if cross is None or not cross.whole:
        return None
    able = exact.sums_in_one_pass(len(cross.ranks))
    return cross if cross.groups.agree_all(able, "agreement on the exact sums' kernels") \
        else None


def _node_groups(communicator: Communicator, settings: Settings) -> Optional[NodeGroups]:
    """The NodeGroups of the node sums, or None where they are off or
    cannot be had ("auto"); an error on every rank where True cannot be had."""
    mode = settings.shared_memory
    if mode is False or (mode == "auto" and (not settings.check or settings.verify
                                             or settings.on_failure == "shrink")):
        return None
    groups = NodeGroups(communicator, settings.node_size)
    reason = groups.reasons(groups.problem or shared_memory_problem())
    if not reason and mode == "auto" and groups.local_size == 1:
        # every node has one rank (sizes are equal): nothing to share, and
        # the node path would only add a pass to MPI's Allreduce
        reason = "one rank per node"
    if not reason:
        remove_orphans()       # segments left by killed processes of this machine
        return groups
    if mode is True:
        raise RuntimeError(f"shared_memory=True cannot be had here ({reason}); "
                           "use shared_memory='auto' or False")
    _log.debug("shared memory off: %s", reason)
    return None


def _cross_memory(settings: Settings, groups: Optional[NodeGroups]) -> Optional[CrossMemory]:
    """The cross-memory backend where it can be had: with cross_memory="auto"
    where shared_memory is "auto" too and every local rank can read its
    peers' memory (probed, agreed); an error on every rank where True cannot
    be had."""
    mode = settings.cross_memory
    if mode is False or (mode == "auto" and settings.shared_memory != "auto"):
        return None
    if groups is None:
        if mode is True:
            raise RuntimeError("cross_memory=True cannot be had here: there are no node sums "
                               "(one rank per node, verify=True, or on_failure='shrink'); "
                               "use cross_memory='auto' or False")
        return None
    problem = cross_memory_problem(groups)
    if problem is None:
        return CrossMemory(groups)
    if mode is True:
        raise RuntimeError(f"cross_memory=True cannot be had here ({problem}); "
                           "use cross_memory='auto' or False")
    _log.debug("cross-memory sums off: %s", problem)
    return None

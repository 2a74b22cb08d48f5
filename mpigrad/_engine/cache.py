"""Plans and bucket buffers per gradient signature (no MPI), bounded by the
bytes their buffers hold: least recently used signatures go first, and the one
in use is always kept."""

import operator
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple
from collections import OrderedDict

import numpy as np

from .._base.array_lists import signature
from .._base.description import Pairs, part
from .buffers import BucketBuffers, Runs, message_runs, picker
from .choice import Trial
from .._backends.node_memory import SharedBuckets
from .._backends.wire import wire_for
from .._base.settings import Settings
from .._base.dtypes import check_gradient_dtype, finite_limit
from .plan import DENSE, SKIP, SPARSE, FusionPlan, GradSpec, make_plan
from .._base.row_sparse import RowSparse

__all__ = ["MessageRuns", "Planned", "PlanCache", "DEFAULT_CACHE_BYTES"]

#: Bucket-buffer bytes the cache keeps across signatures before evicting.
DEFAULT_CACHE_BYTES = 1 << 30


_SIGNATURE = operator.attrgetter("__class__", "shape", "dtype")


def _gradient(spec: GradSpec) -> str:
    """One gradient as a Description's item."""
    if spec.kind == SKIP:
        return "skipped"
    assert spec.dtype is not None
    text = f"{spec.kind} {spec.dtype.name}{list(spec.shape)}"
    if spec.index_dtype is not None:
        text += f" indices {spec.index_dtype.name}"
    return text


class MessageRuns(NamedTuple):
    """A plan's buckets summed as one message each run, by how a call sums them."""

    #: in place, where a bucket filled alone may be summed in its gradient's memory
    in_own_memory: Runs
    #: where every bucket is in its buffer on every rank
    in_buffers: Runs
    #: a plain reduce: a bucket that casts in its buffer, the others in the result arenas
    copied: Runs


class Planned:
    """What is kept per gradient signature: the plan, its buffers, the wire
    its float32 buckets travel (``wire_for`` of the Reducer's ``wire``), and
    what the cross-rank check compares: the gradients as a Description's
    items, and the fingerprint of those with the Reducer's settings (``part``)."""

    __slots__ = ("plan", "buffers", "fingerprint", "items", "index_dtypes",
                 "dense_positions", "pick_dense", "limits", "dtypes", "shared",
                 "sharing_tried", "filled_alone", "runs", "views_given", "bucket_of", "wire",
                 "trials")

    def __init__(self, specs: Sequence[GradSpec], plan: FusionPlan, agreed_settings: Pairs,
                 wire: Optional[str]) -> None:
        self.plan = plan
        self.dense_positions = tuple(i for b in plan.buckets for i in b.indices)
        self.bucket_of = {index: i for i, b in enumerate(plan.buckets) for index in b.indices}
        self.pick_dense = picker(self.dense_positions)
        # per bucket: where a reduced value stops being finite once cast back
        # (the check_finite flag)
        self.limits = tuple(finite_limit(specs[i].dtype for i in b.indices)
                            for b in plan.buckets)
        # buckets that one gradient fills alone in its wire dtype: in place,
        # they are reduced in its own memory
        self.filled_alone = tuple(i for i, b in enumerate(plan.buckets)
                                  if len(b.indices) == 1 and specs[b.indices[0]].dtype == b.dtype)
        self.dtypes = [s.dtype for s in specs]
        self.wire = wire_for(wire, (self.dtypes[i] for i in self.dense_positions))
        self.buffers = BucketBuffers(plan, self.dtypes)
        # the buckets summed as one message (Negotiator._runs)
        casting = {i for i, cast in enumerate(self.buffers.casts) if cast}
        self.runs = MessageRuns(in_own_memory=message_runs(plan.buckets, set(self.filled_alone)),
                                in_buffers=message_runs(plan.buckets, set()),
                                copied=message_runs(plan.buckets, casting))
        # once its buckets live in node memory, where they do
        self.shared: Optional[SharedBuckets] = None
        # whether node memory was tried for it ("auto": a plan whose node
        # memory could not be made goes through MPI and is not tried again)
        self.sharing_tried = False
        self.views_given = False     # whether bucket_views handed out its buffers
        # per kind of call (CallTraits), the measured choice of its backend
        self.trials: Dict[Any, Trial] = {}
        self.items = tuple(_gradient(s) for s in specs)
        self.fingerprint = part("body", (agreed_settings, self.items))
        self.index_dtypes = tuple((i, s.index_dtype) for i, s in enumerate(specs)
                                  if s.kind == SPARSE)

    def move_to_shared(self, shared: SharedBuckets) -> None:
        """Put the buckets into ``shared`` (a SharedBuckets for this plan):
        from now on the bucket buffers are this rank's part of node memory."""
        self.buffers = BucketBuffers(self.plan, self.dtypes, memory=shared.allocate)
        self.shared = shared
        self.sharing_tried = True

    def mark_not_shared(self) -> None:
        """Node memory could not be made for this plan: it goes through MPI
        and is not tried again."""
        self.sharing_tried = True

    def hand_out_views(self, like: Sequence[Any]) -> List[Any]:
        """``like`` (a list of leaves) with every dense gradient of its wire
        dtype replaced by its view into the bucket buffers; remembered (a plain
        reduce in node memory would write into them)."""
        self.views_given = True
        out = list(like)
        for bucket, views in zip(self.plan.buckets, self.buffers.views):
            for index, view in views:
                if like[index].dtype == bucket.dtype:
                    out[index] = view
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held by the bucket buffers (in node memory: every local
        rank's segment, since this rank maps them all)."""
        return self.plan.nbytes if self.shared is None else self.shared.mapped_bytes


class PlanCache:
    """Planned entries by gradient specs, and by the fast per-call key.

    Args:
        settings: the reducer's Settings (split indices, bucket cap, and what
            the fingerprint records).
        limit_bytes: buffer bytes kept before least recently used entries are
            evicted.
    """

    def __init__(self, settings: Settings, limit_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.settings = settings
        # the settings every rank must share, as a Description's pairs
        self.agreed = settings.agreed()
        self.limit_bytes = limit_bytes
        # specs -> Planned, least recently used first
        self._entries: "OrderedDict[Tuple[GradSpec, ...], Planned]" = OrderedDict()
        self._by_key: Dict[Tuple[Any, ...], Planned] = {}     # fast key -> Planned
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def specs(self, grads: Sequence[Any]) -> Tuple[GradSpec, ...]:
        """The GradSpec of every host gradient; TypeError/ValueError name a bad one."""
        skip = self.settings.skip
        if skip is not None and len(skip) != len(grads):
            raise ValueError(f"skip: expecting {len(grads)} flags (one per gradient), "
                             f"got {len(skip)}")
        specs = []
        for index, grad in enumerate(grads):
            if skip is not None and skip[index]:
                specs.append(GradSpec(SKIP, (), None))
            elif isinstance(grad, RowSparse):
                specs.append(GradSpec(SPARSE, grad.dense_shape, grad.dtype,
                                      grad.indices.dtype))
            elif isinstance(grad, np.ndarray):
                check_gradient_dtype(grad.dtype, index)
                specs.append(GradSpec(DENSE, grad.shape, grad.dtype))
            else:
                raise TypeError(f"grads[{index}]: expecting an array, "
                                f"got {type(grad).__name__}")
        return tuple(specs)

    def lookup(self, grads: Sequence[Any]) -> Planned:
        """The entry of host ``grads`` (a list of leaves): found by a fast key
        of types, shapes and dtypes, validated and planned only on a miss."""
        key: Any = signature(grads)      # (bytes: every leaf a numpy array of a known dtype)
        if key is None:
            try:
                key = tuple(map(_SIGNATURE, grads))
            except AttributeError:       # not an array (an error, or a skipped object)
                return self.get(self.specs(grads))
        entry = self._by_key.get(key)
        if entry is None or any(grads[i].indices.dtype != d for i, d in entry.index_dtypes):
            entry = self._by_key[key] = self.get(self.specs(grads))
        return entry

    def get(self, specs: Tuple[GradSpec, ...]) -> Planned:
        """The Planned entry of ``specs``, planned on a miss."""
        entry = self._entries.get(specs)
        if entry is not None:
            self._entries.move_to_end(specs)
            return entry
        plan = make_plan(specs, self.settings.split_indices, self.settings.bucket_bytes)
        entry = Planned(specs, plan, self.agreed, self.settings.wire)
        self._entries[specs] = entry
        self.nbytes += entry.nbytes
        self._evict()
        return entry

    def move_to_shared(self, entry: Planned, shared: SharedBuckets) -> None:
        """``entry.move_to_shared(shared)``, its mapped bytes counted."""
        self.nbytes -= entry.nbytes
        entry.move_to_shared(shared)
        self.nbytes += entry.nbytes
        self._evict()

    def _evict(self) -> None:
        while self.nbytes > self.limit_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self._by_key = {k: e for k, e in self._by_key.items() if e is not old}

    def clear(self) -> None:
        """Drop every entry and its buffers."""
        self._entries.clear()
        self._by_key.clear()
        self.nbytes = 0

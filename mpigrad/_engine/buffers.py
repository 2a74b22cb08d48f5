"""Reusable bucket buffers; pack and unpack with the cast on the copy."""

import operator
import sys
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from .._base.address import address
from .._base.array_lists import gather, own_memory, owned_apart, scatter
from .._base.arena import Slot
from .._base.dtypes import assign
from .plan import Bucket, FusionPlan

Arenas = Dict[np.dtype, np.ndarray]
#: per dtype, the arrays the last calls handed out of (the two latest), to reuse
Recent = Dict[np.dtype, List[np.ndarray]]
#: (first, last) bucket ranges summed as one message each, in launch order
Runs = Tuple[Tuple[int, int], ...]
#: given {wire dtype: elements}, the 1-D arrays the buckets live in
Memory = Callable[[Dict[np.dtype, int]], Arenas]

__all__ = ["BucketBuffers", "Runs", "arena_sizes", "check_no_aliasing", "message_runs", "picker"]


class BucketBuffers:
    """One contiguous wire buffer per bucket of a plan, allocated once.

    ``views[i]`` holds ``(position, view)`` pairs: each gradient's slot in
    bucket ``i``, shaped like the gradient. Trainers that write their
    gradients straight into these views (``Reducer.bucket_views``) skip the
    pack and unpack copies altogether.

    Args:
        plan: the FusionPlan whose buckets these buffers hold.
        dtypes: the gradient dtype of each position of the plan.
        memory: ``memory({wire dtype: elements})`` gives the 1-D arrays the
            buckets live in (default: new numpy arrays).
    """

    def __init__(self, plan: FusionPlan, dtypes: Sequence[Any],
                 memory: Optional[Memory] = None) -> None:
        self.plan = plan
        # bucket i is arrays[i], elements starts[i]: of its wire dtype's arena
        self.arrays, self.starts = _side_by_side(plan.buckets, memory)
        self.slots = [list(b.slices()) for b in plan.buckets]
        self.views = [
            [(index, array[start:stop].reshape(shape)) for index, start, stop, shape in slots]
            for slots, array in zip(self.slots, self.arrays)
        ]
        # per bucket: its gradients picked out of the leaves in one call, and
        # its views side by side with their addresses (zero-copy is
        # recognised by memory: a fresh numpy view of a torch tensor made
        # from a bucket view is as zero-copy as the view itself)
        self.pick = [picker(b.indices) for b in plan.buckets]
        self.bare_views = [tuple(view for _, view in views) for views in self.views]
        self.addresses = [tuple(view.ctypes.data for view in views) for views in self.bare_views]
        # buckets whose gradients need a cast on the way in and out
        self.casts = [any(dtypes[index] != b.dtype for index in b.indices) for b in plan.buckets]
        # buckets of gradients of one half-precision dtype (the plan's dtypes: alike on
        # every rank): in place, a backend that sums halves sums them in half precision
        # memory (Where.HALF), the gradient's own where it fills the bucket alone
        self.half_only = [b.dtype.itemsize > 2 and len({np.dtype(dtypes[k]) for k in b.indices})
                          == 1 and np.dtype(dtypes[b.indices[0]]).itemsize == 2
                          for b in plan.buckets]
        self._half_dtypes = [np.dtype(dtypes[b.indices[0]]) for b in plan.buckets]
        self._half_staging: Optional[Dict[int, np.ndarray]] = None    # bucket -> its staging
        self._layout_outputs(dtypes)
        self._arenas: Recent = {}    # gradient dtype -> the last calls' result arenas
        # wire dtype -> a private arena (reduce-scatter, allgather)
        self._staging: Optional[Arenas] = None
        self._shards: Recent = {}    # wire dtype -> the last reduce-scatters' shards

    def _layout_outputs(self, dtypes: Sequence[Any]) -> None:
        # results of plain reduce(): one arena per gradient dtype, in bucket order
        self.out_sizes: Dict[np.dtype, int] = {}
        # per bucket: (position, dtype, start, stop, shape) of its results
        self.out_slots: List[List[Tuple[int, np.dtype, int, int, Tuple[int, ...]]]] = []
        # per bucket: (dtype, start, stop) of its results where one arena holds them
        self.out_span: List[Optional[Tuple[np.dtype, int, int]]] = []
        for slots in self.slots:
            placed = []
            for index, start, stop, shape in slots:
                dtype = dtypes[index]
                offset = self.out_sizes.get(dtype, 0)
                self.out_sizes[dtype] = offset + (stop - start)
                placed.append((index, dtype, offset, offset + stop - start, shape))
            kinds = {p[1] for p in placed}
            self.out_span.append((placed[0][1], placed[0][2], placed[-1][3])
                                 if len(kinds) == 1 else None)
            self.out_slots.append(placed)

    def held(self, i: int, grads: Sequence[Any]) -> int:
        """How many of bucket ``i``'s gradients are its own views (zero-copy):
        the view objects themselves (the fast test) or arrays of exactly their
        memory (address, shape, strides, dtype), whatever object carries it."""
        picked, views = self.pick[i](grads), self.bare_views[i]
        same = sum(map(operator.is_, picked, views))
        if same == len(picked) or own_memory(picked):
            return same            # (arrays that own their memory are no views)
        return sum(map(_same_memory, picked, views, self.addresses[i]))

    def sums_in_results(self, i: int, results: "Results") -> bool:
        """Whether a plain reduce sums bucket ``i`` in its ``results`` (from
        ``new_outputs``): they lie back to back in an arena of the wire dtype,
        so packing the gradients there is the only copy owed."""
        span = results.spans[i]
        return span is not None and span.dtype == self.plan.buckets[i].dtype

    def half_results(self, i: int, results: "Results") -> bool:
        """Whether bucket ``i``'s gradients are all float16 (or all bfloat16) and its
        ``results`` lie back to back: the bucket can be summed there, in half precision
        memory (Where.HALF)."""
        span = results.spans[i]
        return span is not None and span.dtype != self.plan.buckets[i].dtype and \
            span.dtype.itemsize == 2

    def half_memory(self, i: int, grads: Sequence[Any]) -> Optional[np.ndarray]:
        """Bucket ``i``'s gradient as 1-D when it fills the bucket alone, in half
        precision and C order: its addend is read out of it. Else None."""
        bucket = self.plan.buckets[i]
        if len(bucket.indices) != 1:
            return None
        grad = grads[bucket.indices[0]]
        if grad.dtype.itemsize != 2 or not grad.flags.c_contiguous:
            return None
        flat: np.ndarray = grad.reshape(-1)
        return flat

    def half_staged(self, i: int, grads: Sequence[Any], outs: Sequence[Any]
                    ) -> Tuple[np.ndarray, Callable[[], None], None]:
        """(memory, write-out, None) of bucket ``i``'s half-precision gradients:
        copied side by side into half-precision staging (half the bytes of a
        float32 bucket, no cast), summed there, written into ``outs`` after (the
        gradients in place, or a plain reduce's results that do not lie back to back)."""
        if self._half_staging is None:
            self._half_staging = self._half_arenas()
        flat = self._half_staging[i]
        self.gather(i, grads, flat)

        def write_out() -> None:
            if not scatter(flat, self.pick[i](outs)):
                for index, start, stop, shape in self.slots[i]:
                    outs[index][...] = flat[start:stop].reshape(shape)
        return flat, write_out, None

    def _half_arenas(self) -> Dict[int, np.ndarray]:
        """{bucket of half gradients: its staging}, the buckets side by side in an arena per
        dtype (neighbours are summed as one region: larger moves): first those of several
        gradients, in plan order, then those of one, which sums in the gradient's own
        memory wherever that is contiguous, so the staged ones lie next to each other."""
        halves = sorted((i for i, half in enumerate(self.half_only) if half),
                        key=lambda i: len(self.plan.buckets[i].indices) == 1)
        sizes: Dict[np.dtype, int] = {}
        for i in halves:
            dtype = self._half_dtypes[i]
            sizes[dtype] = sizes.get(dtype, 0) + self.plan.buckets[i].size
        arenas = {dtype: np.empty(n, dtype) for dtype, n in sizes.items()}
        staging, used = {}, dict.fromkeys(sizes, 0)
        for i in halves:
            dtype, size = self._half_dtypes[i], self.plan.buckets[i].size
            staging[i] = arenas[dtype][used[dtype]:used[dtype] + size]
            used[dtype] += size
        return staging

    def own_memory(self, i: int, grads: Sequence[Any]) -> Optional[np.ndarray]:
        """Bucket ``i``'s gradient as 1-D when it fills the bucket alone in the
        wire dtype and C order and is not the bucket's view: in place, it is
        summed in its own memory. Else None."""
        bucket = self.plan.buckets[i]
        if len(bucket.indices) != 1:
            return None
        grad = grads[bucket.indices[0]]
        if (grad.dtype != bucket.dtype or not grad.flags.c_contiguous
                or _same_memory(grad, self.bare_views[i][0], self.addresses[i][0])):
            return None
        flat: np.ndarray = grad.reshape(-1)
        return flat

    def pack(self, i: int, grads: Sequence[Any]) -> np.ndarray:
        """Copy bucket ``i``'s gradients into its buffer, upcasting half precision."""
        return self.pack_into(i, grads, self.arrays[i])

    def pack_into(self, i: int, grads: Sequence[Any], flat: np.ndarray) -> np.ndarray:
        """Copy bucket ``i``'s gradients into the 1-D ``flat`` (its buffer, or
        memory of its size elsewhere), upcasting half precision; return it."""
        if self.casts[i]:
            for index, start, stop, shape in self.slots[i]:
                assign(flat[start:stop].reshape(shape), grads[index])
        else:
            self.gather(i, grads, flat)
        return flat

    def gather(self, i: int, grads: Sequence[Any], flat: np.ndarray) -> None:
        """Copy bucket ``i``'s gradients (all of its wire dtype) side by side
        into the 1-D ``flat``, in logical (C) order: one call for the bucket."""
        gather(self.pick[i](grads), flat)

    def arena_slots(self, dtype: np.dtype) -> List[Slot]:
        """The Slot of every gradient of the buckets of wire dtype ``dtype``
        in its arena (the buckets back to back in plan order)."""
        return [Slot(position, start + lo, start + hi, shape)
                for bucket, start, slots in zip(self.plan.buckets, self.starts, self.slots)
                if bucket.dtype == dtype for position, lo, hi, shape in slots]

    def staging(self) -> Arenas:
        """{wire dtype: a private arena of the buckets' elements}: made once
        (fresh memory would page-fault in every call), never handed out."""
        if self._staging is None:
            self._staging = {d: np.empty(n, d) for d, n in arena_sizes(self.plan.buckets).items()}
        return self._staging

    def unpack(self, i: int, outs: Sequence[Any]) -> None:
        """Copy bucket ``i``'s buffer into the arrays ``outs``, casting back."""
        if self.casts[i]:
            for index, view in self.views[i]:
                assign(outs[index], view)
        elif not scatter(self.arrays[i], self.pick[i](outs)):
            for index, view in self.views[i]:
                outs[index][...] = view

    def new_outputs(self, grads: Sequence[Any], outs: List[Any]) -> "Results":
        """Put a new, uninitialised result array for every bucketed gradient into
        ``outs``; return the Results behind them.

        C-contiguous results are views into one arena per gradient dtype (laid
        out in bucket order, so that a bucket of one dtype unpacks with a single
        copy); others get arrays of their input's memory order.
        """
        arenas = {dtype: _reusable(self._arenas, dtype, size)
                  for dtype, size in self.out_sizes.items()}
        spans: List[Optional[np.ndarray]] = []
        for slots, span in zip(self.out_slots, self.out_span):
            whole = True
            for index, dtype, start, stop, shape in slots:
                grad = grads[index]
                if grad.flags.c_contiguous:
                    result = arenas[dtype][start:stop]
                    outs[index] = result if len(shape) == 1 else result.reshape(shape)
                else:
                    outs[index] = np.empty_like(grad, order="K")
                    whole = False
            spans.append(arenas[span[0]][span[1]:span[2]] if whole and span else None)
        return Results(arenas, spans)

    def given_outputs(self, outputs: Sequence[Any], outs: List[Any]) -> "Results":
        """Put the caller's result array (``out=``) of every bucketed gradient into
        ``outs``; return the Results behind them: a bucket whose one gradient's output
        is C-contiguous is summed straight into it (its span), others are unpacked
        into theirs."""
        spans: List[Optional[np.ndarray]] = []
        for slots in self.out_slots:
            for index, _, _, _, _ in slots:
                outs[index] = outputs[index]
            only = outputs[slots[0][0]] if len(slots) == 1 else None
            spans.append(only.reshape(-1) if only is not None and only.flags.c_contiguous
                         else None)
        return Results({}, spans)

    def shard(self, dtype: np.dtype, size: int) -> np.ndarray:
        """A 1-D array of ``size`` elements of ``dtype`` for a reduce-scatter's
        shard: one of the last calls' that nothing references any more."""
        return _reusable(self._shards, dtype, size)

    def unpack_new(self, i: int, outs: Sequence[Any], results: "Results",
                   source: Optional[np.ndarray] = None) -> None:
        """Copy bucket ``i``'s results (from ``source``, default its buffer)
        into the arrays made by ``new_outputs``, casting back."""
        source = self.arrays[i] if source is None else source
        target = results.spans[i]
        if target is not None:
            assign(target, source)
            return
        if not self.casts[i] and scatter(source, self.pick[i](outs)):
            return
        for (index, _, _, _, shape), (_, start, stop, _) in zip(self.out_slots[i],
                                                                self.slots[i]):
            assign(outs[index], source[start:stop].reshape(shape))


def _reusable(store: Recent, dtype: np.dtype, size: int) -> np.ndarray:
    """One of the last two calls' arrays (``store[dtype]``) when none of the arrays
    handed out of it is referenced any more, else a new one kept in place of the
    older: fresh memory costs a page fault per page on first touch (about a third
    of a plain ResNet-50 reduce). Two, for a caller that holds one call's results
    while it makes the next (``grads = reducer.reduce(grads)``, or ``out = ...`` in
    a loop): float32 ResNet-50 at 2 ranks 36 -> 25 ms a call, as when dropped."""
    recent = store.setdefault(dtype, [])
    for array in recent:
        # referenced by the list, ``array`` and getrefcount's argument alone:
        # every array handed out of it (and every view of one) is gone
        if array.size == size and sys.getrefcount(array) <= 3:
            return array
    array = np.empty(size, dtype)
    recent[:] = [array, *recent[:1]]
    return array


def _same_memory(grad: np.ndarray, view: np.ndarray, address: int) -> bool:
    """Whether the array ``grad`` is exactly ``view`` (at ``address``) in memory."""
    if grad is view:
        return True
    if grad.base is None:             # owns its memory: not a view into a bucket
        return False
    return (grad.shape == view.shape and grad.dtype == view.dtype
            and grad.strides == view.strides and grad.ctypes.data == address)


def picker(indices: Sequence[int]) -> Callable[[Sequence[Any]], Tuple[Any, ...]]:
    """A function returning the items of a list at ``indices``, as a tuple."""
    if not indices:
        return lambda items: ()
    if len(indices) == 1:
        index = indices[0]
        return lambda items: (items[index],)
    return operator.itemgetter(*indices)


def arena_sizes(buckets: Sequence[Bucket]) -> Dict[np.dtype, int]:
    """{wire dtype: elements} of the buckets of each wire dtype together."""
    sizes: Dict[np.dtype, int] = {}
    for b in buckets:
        sizes[b.dtype] = sizes.get(b.dtype, 0) + b.size
    return sizes


def arena_starts(buckets: Sequence[Bucket]) -> List[int]:
    """Where each bucket starts in its wire dtype's arena: the buckets of
    each wire dtype back to back, in plan order."""
    offsets: Dict[np.dtype, int] = {}
    starts: List[int] = []
    for b in buckets:
        start = offsets.get(b.dtype, 0)
        offsets[b.dtype] = start + b.size
        starts.append(start)
    return starts


def _side_by_side(buckets: Sequence[Bucket], memory: Optional[Memory] = None
                  ) -> Tuple[List[np.ndarray], List[int]]:
    """One array per bucket, the buckets of each wire dtype back to back in
    one allocation (in plan order), so that neighbours reduce as one message;
    and where each starts in its allocation."""
    sizes = arena_sizes(buckets)
    arenas = (memory(sizes) if memory is not None
              else {dtype: np.empty(size, dtype) for dtype, size in sizes.items()})
    starts = arena_starts(buckets)
    return [arenas[b.dtype][s:s + b.size] for b, s in zip(buckets, starts)], starts


def message_runs(buckets: Sequence[Bucket], alone: Set[int]) -> Runs:
    """[(first, last)]: the buckets summed as one message (in pieces): runs
    of consecutive buckets of one wire dtype, each bucket of ``alone`` (whose
    memory may lie elsewhere) a run of its own. Decided by the plan alone, so
    that every rank sends the same messages whatever its arrays' layout."""
    runs: List[List[int]] = []
    for i, bucket in enumerate(buckets):
        if (runs and i not in alone and runs[-1][1] == i - 1 and i - 1 not in alone
                and buckets[i - 1].dtype == bucket.dtype):
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return tuple((first, last) for first, last in runs)


class Results:
    """The memory behind one call's new result arrays."""

    __slots__ = ("arenas", "spans")

    def __init__(self, arenas: Arenas, spans: List[Optional[np.ndarray]]) -> None:
        self.arenas = arenas     # gradient dtype -> arena
        self.spans = spans       # per bucket: its results' arena slice, or None


def _extent(array: np.ndarray) -> Tuple[int, int]:
    """[lo, hi): the byte addresses ``array``'s elements lie between, whatever
    object owns the memory (negative and zero strides included)."""
    lo = address(array)
    if array.flags.c_contiguous:
        return lo, lo + array.nbytes
    hi = lo + array.itemsize
    for n, stride in zip(array.shape, array.strides):
        if stride < 0:
            lo += (n - 1) * stride
        else:
            hi += (n - 1) * stride
    return lo, hi


def check_no_aliasing(grads: Sequence[Any], positions: Sequence[int],
                      noun: str = "grads", names: Optional[Sequence[str]] = None,
                      why: Optional[str] = None,
                      picked: Optional[Sequence[Any]] = None,
                      read_only: Collection[int] = ()) -> None:
    """Raise ValueError if two of the gradients at ``positions`` share memory:
    in place, one would be written twice (and where only some ranks alias,
    the ranks would end with different values). Overlap is found by the byte
    ranges the arrays span, whatever objects carry them (views,
    ``np.frombuffer``, torch tensors), and confirmed element-exactly
    (``np.shares_memory``). Arrays that own their memory cannot overlap one
    another (unless one is given twice): a call of those alone costs one
    pass over them. ``names``: each position's name (default ``noun[i]``);
    ``why``: what the error says after it; ``picked``: the gradients at
    ``positions``, where the caller has them already; ``read_only``: positions
    that are only read, two of which may share memory."""
    if owned_apart([grads[i] for i in positions] if picked is None else picked):
        return
    spans = sorted((*_extent(grads[i]), i) for i in positions if grads[i].size)
    open_spans: List[Tuple[int, int]] = []   # (hi, position) of spans not yet passed
    for lo, hi, index in spans:
        open_spans = [(end, other) for end, other in open_spans if end > lo]
        for _, other in open_spans:
            if index in read_only and other in read_only:
                continue
            if np.shares_memory(grads[index], grads[other]):
                first, second = sorted((index, other))
                name = (lambda i: names[i]) if names is not None else (lambda i: f"{noun}[{i}]")
                raise ValueError(
                    f"{name(first)} and {name(second)} share memory: " + (why or (
                        "reduced in place, it would be reduced twice; pass separate arrays "
                        "(a copy)" + (" or inplace=False" if noun == "grads" else ""))))
        open_spans.append((hi, index))

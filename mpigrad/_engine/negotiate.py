"""Negotiation: one call's local checks and its one tiny agreement, turned into
a frozen CallPlan that the pipeline executes without deciding anything again.

Every rank validates its gradients and makes its local decisions (which
buckets it holds zero-copy, which it would sum in a gradient's own memory);
one Allreduce then agrees on the structure fingerprint, turns a local error
into an error on every rank, and ORs the ranks' Flags. From the agreed flags
follow what must be the same everywhere (the call kind, the message runs, the
backend); from this rank's arrays, where each bucket is summed.
"""

import enum
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._backends import SumBackend
from .._backends.select import Backends, CallTraits
from .._base.settings import Settings
from .._comm.communicator import Communicator
from .._comm.checked import checked
from .._base.description import Description, Pairs, part
from .._base.arrays import from_host, to_host
from .._base.array_lists import writeable
from .buffers import BucketBuffers, Results, Runs, arena_sizes, check_no_aliasing
from .cache import Planned, PlanCache
from .choice import Trial
from .._base.tree import flatten, leaf_paths, structure, unflatten
from .._base.validate import agreed

__all__ = ["Flags", "Where", "Inputs", "CallPlan", "Negotiator", "leaves_of"]


class Flags(enum.IntFlag):
    """What the ranks of a call agree on, ORed over the ranks in one collective."""

    REDUCE = 1             # the call kinds: reduce(inplace=False)
    REDUCE_INPLACE = 2     # reduce(inplace=True)
    START = 4              # start(): in place, overlapped
    BUCKET_VIEWS = 8       # bucket_views() with node memory (collective)
    SETUP_NODE = 16        # some rank's plan has no node memory yet: all set it up
    VIEWS_GIVEN = 32       # some rank handed out the plan's bucket views
    PACKED = 64            # some rank packs some bucket (not every one zero-copy)
    ZERO_COPY = 128        # some rank holds some bucket as its views
    OWN_MEMORY = 256       # in place, some rank sums a bucket filled alone by a
                           # gradient in that gradient's own memory
    REDUCE_SCATTER = 512   # reduce_scatter()
    ALLGATHER = 1024       # allgather_shards(): writes the caller's arrays
    START_SCATTER = 2048   # start_reduce_scatter(): overlapped


#: the call kinds that write results into the caller's arrays
IN_PLACE = (Flags.REDUCE_INPLACE, Flags.START, Flags.ALLGATHER)

KINDS = {Flags.REDUCE: "reduce(inplace=False)", Flags.REDUCE_INPLACE: "reduce(inplace=True)",
         Flags.START: "start()", Flags.BUCKET_VIEWS: "bucket_views()",
         Flags.REDUCE_SCATTER: "reduce_scatter()", Flags.ALLGATHER: "allgather_shards()",
         Flags.START_SCATTER: "start_reduce_scatter()"}

_KIND_FINGERPRINTS = {kind: part("kind", name) for kind, name in KINDS.items()}

#: the calls that move shards of the fused space (mpigrad._engine.scatter),
#: through MPI only: no node memory is set up for them
SHARDED = (Flags.REDUCE_SCATTER, Flags.ALLGATHER, Flags.START_SCATTER)


class Where(enum.Enum):
    """Where one bucket is summed on this rank."""

    CALLER = "caller"      # in place, in the caller's memory: the gradient's own
                           # (filled alone) or its zero-copy bucket views
    BUFFER = "buffer"      # packed into the bucket buffer, copied out after
    RESULT = "result"      # a plain reduce's results, back to back: packed there
    APART = "apart"        # a plain reduce's results, summed out of the gradient that
                           # fills the bucket alone (a backend that reads and writes
                           # apart: cross-memory), nothing packed
    HALF = "half"          # a bucket of float16/bfloat16 gradients (of one dtype),
                           # summed in float32 and rounded back into half precision
                           # memory by a backend that sums half precision
                           # (cross-memory): half the bytes of a float32 buffer. A
                           # plain reduce's results, back to back: the gradients
                           # copied there (or read out of the one that fills the
                           # bucket alone); in place, its one gradient's memory;
                           # else (on this rank) half staging, written out after
    PRIVATE = "private"    # a copy of the bucket buffer, which holds the caller's
                           # gradients (zero-copy views); copied out after


def _outputs(out: Any, host: Sequence[Any], kinds: Any, entry: Planned) -> List[Any]:
    """``out``'s leaves, checked: per dense gradient a writeable numpy array of its shape
    and dtype; None for a RowSparse one (it comes back new); for a skipped one None (it
    comes back as it came) or such an array (a copy of it). Host gradients only; no two
    outputs sharing memory, none sharing a gradient's (results are written while
    gradients are still read: in place is ``inplace=True``); gradients may share
    memory with each other (only read: XLA hands one buffer for equal operands)."""
    leaves, _ = flatten(out)
    if len(leaves) != len(host):
        raise ValueError(f"out: expecting {len(host)} arrays (one per gradient, in the "
                         f"gradients' structure), got {len(leaves)}")
    if kinds is not None and any(k is not None and k[1] for k in kinds):
        raise TypeError("out: results are written into host arrays; the gradients here are "
                        "device arrays: call reduce(grads) without out=")
    sparse = {i for group in entry.plan.sparse for i in group.indices}
    for index, (given, grad) in enumerate(zip(leaves, host)):
        if given is None and (index in sparse or index in entry.plan.skipped):
            continue
        if index in sparse:
            raise TypeError(f"out[{index}]: expecting None for a RowSparse gradient (it "
                            f"comes back as a new RowSparse), got {type(given).__name__}")
        if type(given) is not np.ndarray:
            raise TypeError(f"out[{index}]: expecting a numpy array, got "
                            f"{type(given).__name__}")
        if given.shape != np.shape(grad) or given.dtype != getattr(grad, "dtype", None):
            raise ValueError(f"out[{index}]: expecting the gradient's "
                             f"{getattr(grad, 'dtype', type(grad).__name__)} {np.shape(grad)}, "
                             f"got {given.dtype} {given.shape}")
        if not given.flags.writeable:
            raise ValueError(f"out[{index}]: expecting a writeable array, got a read-only one")
    given = [i for i, leaf in enumerate(leaves) if leaf is not None]
    names = [f"out[{i}]" for i in given] + [f"grads[{i}]" for i in given]
    check_no_aliasing([leaves[i] for i in given] + [host[i] for i in given],
                      range(2 * len(given)), names=names,
                      why="results are written there while gradients are read; pass "
                          "separate arrays, or reduce in place (inplace=True)",
                      read_only=range(len(given), 2 * len(given)))     # (the gradients)
    return list(leaves)


def leaves_of(tree: Any) -> Tuple[List[Any], Any]:
    """(leaves, spec) of a gradient tree; its root must be a container."""
    leaves, spec = flatten(tree)
    if spec is not None and len(leaves) == 1 and leaves[0] is tree:
        raise TypeError(f"grads: expecting a list or tuple (or a dict or other pytree) of "
                        f"arrays, got {type(tree).__name__}")
    return leaves, spec


@dataclass(frozen=True)
class Inputs:
    """A call's gradients as given, as host numpy arrays, and how results go back."""

    leaves: List[Any]
    host: List[Any]
    kinds: Optional[List[Any]]       # None: every leaf was numpy
    spec: Any                        # the tree's structure (None: a flat list)

    def hand_back(self, outs: List[Any], inplace: bool) -> Any:
        """``outs`` as the caller's array kinds, in the caller's structure."""
        if self.kinds is not None:
            outs = from_host(outs, self.leaves, self.host, self.kinds, inplace)
        return unflatten(self.spec, outs)


@dataclass(frozen=True)
class CallPlan:
    """Everything one call will do, decided before any data moves."""

    kind: Flags                          # one of KINDS
    flags: Flags                         # agreed over the ranks
    entry: Planned                       # the plan and its buffers
    inputs: Inputs
    outs: List[Any]                      # the results, position by position: a plain
                                         # reduce's new arrays, else the inputs
    results: Any                         # a plain reduce's result memory (None in place)
    runs: Runs                           # buckets summed as one message, in launch order
    where: Tuple[Where, ...]             # per bucket, on this rank
    backend: SumBackend
    private: bool                        # nothing of the caller's written before every
                                         # bucket is summed (verify, on_failure="shrink")
    divisor: int                         # the mean's divisor (1: a sum)
    wire: Optional[str]                  # what its float32 buckets travel as (Planned.wire)
    beside: Any = None                   # check=False: the structure check in flight
                                         # beside the messages (complete() it), else None
    trial: Optional[Trial] = None        # where the backend is measured: the Trial to
                                         # tell this call's time

    @property
    def inplace(self) -> bool:
        """Whether results are written into the caller's arrays."""
        return self.kind in IN_PLACE


class Negotiator:
    """Turns calls into CallPlans for one Reducer.

    Args:
        comm: the Reducer's Communicator.
        settings: its Settings.
        cache: its PlanCache.
        backends: its Backends.
    """

    def __init__(self, comm: Communicator, settings: Settings, cache: PlanCache,
                 backends: Backends) -> None:
        self.comm = comm
        self.settings = settings
        self.cache = cache
        self.backends = backends
        # reduce into private memory, the caller's arrays written only once
        # every bucket is done: with verify, and so that a lost rank
        # (on_failure="shrink") leaves them unchanged
        self.private = settings.verify or settings.on_failure == "shrink"
        self._structures: Dict[Any, int] = {}     # tree spec -> its fingerprint

    def negotiate(self, tree: Any, kind: Flags, divisor: int, agree: Any = None,
                  check: Any = None, out: Any = None) -> CallPlan:
        """Check the call ``kind`` of ``tree`` locally and across ranks; return
        its CallPlan (errors raise on every rank, before any data moves);
        ``divisor``: the mean's (1: a sum).
        ``agree``: the caller's values that every rank must pass alike;
        ``check(entry)``: the call's own local checks of the plan's entry;
        ``out``: a plain reduce's result arrays, given (see ``_outputs``)."""
        inplace = kind in IN_PLACE
        outputs: Optional[List[Any]] = None
        with checked(self.comm, self.settings.check) as call:   # local errors: on every rank
            values = agreed("agree", agree)
            leaves, spec = leaves_of(tree)
            host, kinds = to_host(leaves, inplace)
            inputs = Inputs(leaves, host, kinds, spec)
            entry = self.cache.lookup(host)
            if check is not None:
                check(entry)
            if inplace:
                dense = entry.pick_dense(host)
                if not writeable(dense):
                    index = next(i for i in entry.dense_positions
                                 if not host[i].flags.writeable)
                    raise ValueError(f"grads[{index}]: inplace=True needs a writeable array, "
                                     "got a read-only one; pass inplace=False")
                check_no_aliasing(host, entry.dense_positions, picked=dense)
            if out is not None:
                outputs = _outputs(out, host, kinds, entry)
            # only bucket_views() exposes the buffers: a plan whose views were
            # never handed out has no gradient in them
            held = ([entry.buffers.held(i, host) for i in range(len(entry.plan.buckets))]
                    if entry.views_given else [0] * len(entry.plan.buckets))
            alone = [i in entry.filled_alone and entry.buffers.own_memory(i, host) is not None
                     for i in range(len(held))]
            own = [inplace and a for a in alone]
            call.propose(fingerprint=self._fingerprint_of(kind, entry, spec, values),
                         describe=lambda: self._description(kind, entry, spec, values),
                         bits=int(kind | self._local_flags(entry, kind, held, own)))
        flags = Flags(call.bits)
        if not self.settings.check:
            flags |= Flags.OWN_MEMORY  # unchecked: every rank sums alone-filled buckets there
        # past the agreement every rank's call is valid
        assert entry is not None and inputs is not None
        if flags & Flags.SETUP_NODE:
            self._share(entry)
        traits = CallTraits(
            blocking=kind in (Flags.REDUCE, Flags.REDUCE_INPLACE), inplace=inplace,
            zero_copy=bool(flags & Flags.ZERO_COPY), packed=bool(flags & Flags.PACKED),
            views_given=bool(flags & Flags.VIEWS_GIVEN),
            own_memory=bool(flags & Flags.OWN_MEMORY))
        backend = self.backends.for_call(entry.shared, traits)
        trial = self._trial(entry, backend, traits)
        if trial is not None:
            backend = trial.pick(self.comm)
        node = backend.in_node_memory
        cross = backend.reads_apart
        outs = list(inputs.host)
        results = None
        if outputs is not None:
            results = entry.buffers.given_outputs(outputs, outs)
            for index in entry.plan.skipped:     # as they came, where an array is given
                if outputs[index] is not None:
                    np.copyto(outputs[index], inputs.host[index])
                    outs[index] = outputs[index]
        elif kind == Flags.REDUCE:
            results = entry.buffers.new_outputs(inputs.host, outs)
        return CallPlan(kind=kind, flags=flags, entry=entry, inputs=inputs,
                        outs=outs, results=results,
                        runs=self._runs(entry, kind, flags, node or cross),
                        where=self._where(entry, results, inplace, node, held, own,
                                          alone if cross else (), backend.sums_half),
                        backend=backend,
                        private=self.private and not node, divisor=divisor,
                        wire=entry.wire,
                        beside=call.beside, trial=trial)

    def _trial(self, entry: Planned, backend: SumBackend, traits: CallTraits) -> Optional[Trial]:
        """The measured choice of the backend of ``entry``'s calls like
        ``traits``, where ``backend`` has alternatives (Backends.alternatives)."""
        alternatives = self.backends.alternatives(backend, traits, entry.shared)
        if not alternatives:                 # (most calls: no lookup by their traits)
            return None
        trial = entry.trials.get(traits)
        if trial is None:
            trial = entry.trials[traits] = Trial((backend, *alternatives))
        return trial

    def _local_flags(self, entry: Planned, kind: Flags, held: Sequence[int],
                     own: Sequence[bool]) -> Flags:
        """This rank's side of the flags the ranks OR together. With
        cross-memory sums (and shared_memory="auto"), only bucket_views sets
        up shared buckets: other calls need none."""
        flags = Flags(0)
        if not entry.plan.buckets:
            return flags
        if any(own):
            flags |= Flags.OWN_MEMORY
        if self.backends.groups is not None:
            sizes = [len(b.indices) for b in entry.plan.buckets]
            if not entry.sharing_tried and self.backends.sets_up_node_memory(
                    kind == Flags.BUCKET_VIEWS, kind in SHARDED,
                    packs_in_place=kind == Flags.REDUCE_INPLACE and not any(own)):
                flags |= Flags.SETUP_NODE
            if entry.views_given:
                flags |= Flags.VIEWS_GIVEN
            if any(h != n for h, n in zip(held, sizes)):
                flags |= Flags.PACKED
            if any(held):
                flags |= Flags.ZERO_COPY
        return flags

    def confirm(self, agree: Any) -> None:
        """The end of an overlapped call (with check): every rank passed the
        same ``agree`` values, else an error on every rank."""
        if not self.settings.check:
            return
        with checked(self.comm) as call:
            call.propose(Description("the end of an overlapped call",
                                     agreed=agreed("agree", agree)))

    def _description(self, kind: Flags, entry: Planned, spec: Any, values: Pairs) -> Description:
        """The Description of a call (built only to name a mismatch)."""
        return Description(KINDS[kind], self.cache.agreed, entry.items,
                           None if spec is None else structure(spec), values,
                           paths=leaf_paths(spec))

    def _fingerprint_of(self, kind: Flags, entry: Planned, spec: Any, values: Pairs) -> int:
        """The fingerprint of a call, from the parts kept: its kind's, its
        plan's, its tree's, the caller's values (the XOR of their ``part``s:
        the same on every rank whose call is the same)."""
        fingerprint = _KIND_FINGERPRINTS[kind] ^ entry.fingerprint ^ self._fingerprint(spec)
        return fingerprint ^ part("agreed", values) if values else fingerprint

    def _fingerprint(self, spec: Any) -> int:
        if spec is None:
            return 0
        try:
            return self._structures[spec]
        except KeyError:
            return self._structures.setdefault(spec, part("structure", structure(spec)))

    def _share(self, entry: Planned) -> None:
        """Move ``entry``'s buckets into node memory (collective over the node)."""
        shared = self.backends.share(arena_sizes(entry.plan.buckets))
        if shared is None:
            entry.mark_not_shared()
        else:
            self.cache.move_to_shared(entry, shared)

    def _runs(self, entry: Planned, kind: Flags, flags: Flags, node: bool) -> Runs:
        """The message runs, in launch order (the same on every rank): a
        bucket a message where buckets are summed apart (privately, on the
        node, or overlapped: last bucket first, as backward finishes them);
        else runs of neighbouring buckets of one wire dtype (Planned.runs)."""
        count = len(entry.plan.buckets)
        if kind in (Flags.START, Flags.START_SCATTER) and not node and not self.private:
            return tuple((i, i) for i in reversed(range(count)))
        if self.private or node:
            return tuple((i, i) for i in range(count))
        if kind == Flags.REDUCE:
            return entry.runs.copied
        return entry.runs.in_own_memory if flags & Flags.OWN_MEMORY else entry.runs.in_buffers

    def _where(self, entry: Planned, results: Optional[Results], inplace: bool, node: bool,
               held: Sequence[int], own: Sequence[bool], apart: Sequence[bool],
               halves: bool) -> Tuple[Where, ...]:
        """Where each bucket is summed on this rank (see Where); ``apart``:
        per bucket, whether a plain reduce reads it out of its gradient
        (cross-memory sums; () otherwise); ``halves``: the backend sums
        half-precision memory."""
        buffers: BucketBuffers = entry.buffers
        where: List[Where] = []
        for i, bucket in enumerate(entry.plan.buckets):
            whole = held[i] == len(bucket.indices)
            if node:                   # every bucket in this rank's segment
                where.append(Where.CALLER if inplace and whole else Where.BUFFER)
            elif halves and not held[i] and buffers.half_only[i] and \
                    (results is not None or inplace and not self.private):
                # (by the plan alone: every rank's memory of the bucket is half precision)
                where.append(Where.HALF)
            elif results is not None and apart and apart[i] and not held[i] and \
                    results.spans[i] is not None:
                where.append(Where.APART)
            elif inplace and not self.private and (whole or own[i]):
                where.append(Where.CALLER)
            elif held[i] and (self.private or not inplace):
                where.append(Where.PRIVATE)
            elif results is not None and buffers.sums_in_results(i, results):
                where.append(Where.RESULT)
            else:
                where.append(Where.BUFFER)
        return tuple(where)

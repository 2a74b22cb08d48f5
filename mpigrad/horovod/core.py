"""The framework-neutral core of Horovod's API on mpigrad: the job's state
(``init``, ranks, process sets), handles, and Horovod's collectives on numpy
buffers, which the torch layer wraps.

An adapter onto mpigrad's engine: it maps Horovod's op codes, scale factors,
names and process sets onto a Description, which every rank of the set agrees
on before any data moves (a local error, or a difference, raises on every
rank), and starts the data through the set's MatchingGroup
(mpigrad._collective.matched), whose watch names a stalled or lost rank; large
float sums are the engine's own reductions (node memory, cross-memory). Each
process set has a group of its own (the job's timeout, and with MPI's fault
tolerance a lost rank shrinks it) and a queue of posted collectives, matched
by name as Horovod matches them (matching.py): ranks may post named
collectives in any order; unnamed ones match in program order. A rank in
``join()`` takes part in the others' allreduces with the op's identity.
"""

import functools
import itertools
import os
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._base.bfloat16 import dtype_named
from .._base.description import Description, array_item
from .._base.errors import PeerError, RanksLost, StructureMismatchError
from .._collective import Collective, Kind
from .._collective.matched import MatchingGroup, Placement, Started
from .._collective.ops import HOROVOD, check_op, identity
from .._engine.world import is_communicator, this_rank_alone, world_rank
from ..collectives import allgather_object_on, broadcast_object_on, broadcast_on
from . import timeline
from .adasum import adasum
from .matching import Finish, Key, Post, Posted, Table

__all__ = ["HorovodInternalError", "Average", "Sum", "Adasum", "Min", "Max", "Product",
           "ProcessSet", "global_process_set", "init", "shutdown", "is_initialized", "world",
           "add_process_set", "remove_process_set", "shrink_job", "Handle", "allreduce",
           "sparse_allreduce",
           "allgather", "broadcast", "broadcast_tree", "broadcast_object", "allgather_object",
           "alltoall", "reducescatter", "barrier", "join", "poll", "synchronize", "handle_of",
           "start_timeline", "stop_timeline"]

# Horovod's ReduceOp values
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product"}
#: Horovod's ops -> the op table's (Adasum is a pairwise exchange of its own: adasum.py)
_TABLE_OPS = {Average: "mean", Sum: "sum", Min: "min", Max: "max", Product: "prod"}


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank (Horovod's: a RuntimeError): the
    ranks called different collectives (``MismatchError``: mpigrad's
    StructureMismatchError too), or a peer's call failed (``PeerFailure``:
    mpigrad's PeerError too); one exception, its first line the difference."""


class MismatchError(HorovodInternalError, StructureMismatchError):
    """The ranks called different collectives: Horovod's HorovodInternalError
    and mpigrad's StructureMismatchError in one."""


class PeerFailure(HorovodInternalError, PeerError):
    """A peer's call failed, or a peer left: Horovod's HorovodInternalError and
    mpigrad's PeerError (its ``ranks`` and ``messages``) in one."""

    def __init__(self, error: PeerError) -> None:
        RuntimeError.__init__(self, str(error))
        self.ranks, self.messages = error.ranks, error.messages


class RanksLostError(HorovodInternalError, RanksLost):
    """Ranks were lost and the job shrank to the survivors (with MPI's fault
    tolerance): Horovod's HorovodInternalError, and mpigrad's RanksLost (which
    mpigrad.elastic.run recovers from)."""

    def __init__(self, failed: Sequence[int], size: int) -> None:
        RanksLost.__init__(self, failed, size)


class ProcessSet:
    """The ranks a collective runs among (Horovod's ``hvd.ProcessSet``):
    ``ProcessSet([0, 2])``, registered with ``add_process_set`` (or
    ``init(process_sets=...)``); ``global_process_set`` holds every rank."""

    def __init__(self, ranks: Optional[Sequence[int]] = None) -> None:
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.group: Optional[MatchingGroup] = None    # None where this rank is not in it
        self.process_set_id: Optional[int] = None
        self.table: Optional[Table] = None    # its posted collectives (where included)

    def included(self) -> bool:
        """Whether this rank belongs to the set."""
        return self.group is not None

    def size(self) -> int:
        """How many ranks the set holds (on every rank of the job, as Horovod's)."""
        if self.ranks is not None and self.process_set_id is not None:
            return len(self.ranks)
        return self.joined().size

    def rank(self) -> int:
        """This rank's place in the set (ValueError where it is not in it);
        collectives take roots as ranks of the job (``hvd.rank()``), as Horovod's."""
        return self.joined().rank

    def root(self, root_rank: Any, what: str) -> int:
        """The set's rank of ``root_rank``, a rank of the job in the set."""
        members = list(range(world().size)) if self.ranks is None else self.ranks
        if not isinstance(root_rank, (int, np.integer)) or int(root_rank) not in members:
            raise ValueError(f"{what}: expecting root_rank to be a rank of the job "
                             f"(hvd.rank()) in the process set's ranks {members}, got "
                             f"{root_rank!r}")
        return members.index(int(root_rank))

    def joined(self) -> MatchingGroup:
        """The set's group (ValueError where this rank is not in it)."""
        if self.group is None:
            raise ValueError(f"this rank ({world().rank}) is not in {self}: expecting a "
                             "process set that holds it (hvd.add_process_set first)")
        return self.group

    def communicator(self) -> Any:
        """The set's mpi4py communicator, for a Reducer (ValueError where this
        rank is not in it)."""
        return self.joined().comm

    def reducing_communicator(self) -> Any:
        """The communicator an optimizer of the set reduces over: the set's,
        or this rank alone where it is not in the set (as Horovod's, whose
        optimizer there steps on the rank's own gradients)."""
        return self.communicator() if self.included() else this_rank_alone()

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()


class _Job:
    """What init() sets up."""

    def __init__(self) -> None:
        self.group: Optional[MatchingGroup] = None
        self.placement: Optional[Placement] = None
        self.sets: Dict[int, ProcessSet] = {}
        self.handles: Dict[int, "Handle"] = {}
        self.next_handle = itertools.count()
        self.next_set = itertools.count(1)


_job = _Job()


def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet]] = None) -> None:
    """Set up the job over ``comm`` (an mpi4py communicator, a list of
    ranks of COMM_WORLD, or None: COMM_WORLD); collective. Again: nothing."""
    if _job.group is not None:
        return
    if isinstance(comm, (list, tuple)):
        ranks = list(comm)
        group = MatchingGroup.of_world_ranks(ranks, "hvd.init's communicator")
        if group is None:
            raise ValueError(f"init: this rank ({world_rank()} of COMM_WORLD) is not in the "
                             f"job's ranks {ranks}: it takes part in the split only")
    elif comm is None or is_communicator(comm):
        group = MatchingGroup.of(comm)
    else:
        raise TypeError(f"init: expecting an mpi4py communicator or a list of ranks, "
                        f"got {type(comm).__name__}")
    _register(global_process_set, group, 0)
    _set_world(group)
    for process_set in process_sets or ():
        add_process_set(process_set)
    if os.environ.get("HOROVOD_TIMELINE"):
        start_timeline(os.environ["HOROVOD_TIMELINE"],
                       os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0") not in ("", "0"))


def shutdown() -> None:
    """Forget the job's state (MPI itself ends with the program)."""
    for process_set in list(_job.sets.values()):
        if process_set is not global_process_set:
            remove_process_set(process_set)
    if global_process_set.group is not None:
        global_process_set.group.free()
    _job.sets.clear()
    _job.handles.clear()
    _job.group = _job.placement = None


def is_initialized() -> bool:
    return _job.group is not None


def world() -> MatchingGroup:
    """The job's group (ValueError before init)."""
    if _job.group is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _job.group


def placement() -> Placement:
    """This rank's place among its node's ranks and across the nodes."""
    world()
    assert _job.placement is not None
    return _job.placement


def _set_world(group: MatchingGroup) -> None:
    """Make ``group`` the job's (and the global set's), and find its ranks' nodes."""
    _job.group = group
    _job.placement = group.placement()
    global_process_set.group = group


def _forget(process_set: ProcessSet) -> None:
    """Unregister ``process_set`` (its group is freed or lost)."""
    assert process_set.process_set_id is not None
    del _job.sets[process_set.process_set_id]
    process_set.group, process_set.process_set_id, process_set.table = None, None, None


def _register(process_set: ProcessSet, group: Optional[MatchingGroup],
              number: int) -> ProcessSet:
    process_set.group = group
    process_set.process_set_id = number
    process_set.table = None if group is None else Table(group, _take_part)
    _job.sets[number] = process_set
    return process_set


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks); collective
    over every rank of the job, which must pass the same ranks; returns it."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    size = world().size
    ranks = process_set.ranks

    def describe() -> Description:
        if not ranks or any(not 0 <= r < size for r in ranks):
            raise ValueError(f"add_process_set: expecting ranks in [0, {size}), got {ranks}")
        return Description("add_process_set", (("ranks", tuple(ranks)),))

    def post(everyone: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(everyone, joined, "add_process_set")
        sub = everyone.split_group(everyone.rank in (ranks or ()), "the split into process sets")
        return [], lambda: sub
    sub = _post(global_process_set, "add_process_set", None, describe, post).wait()
    return _register(process_set, sub, next(_job.next_set))


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (not the global one); collective."""
    if process_set is global_process_set or process_set.process_set_id not in _job.sets:
        return False
    if process_set.group is not None:
        process_set.group.free()
    _forget(process_set)
    return True


@contextmanager
def _horovod_errors(group: MatchingGroup) -> Iterator[None]:
    """Horovod's errors for mpigrad's: a difference across ranks or a peer's
    failure is HorovodInternalError (mpigrad's error chained). A lost rank
    inside the block: in a job launched with fault tolerance (ULFM), the
    set's group shrank to the survivors (RanksLost); the job follows
    it (hvd.rank() and size() change; process sets other than the global
    one are dropped) and RanksLostError (a HorovodInternalError) is raised,
    which hvd.elastic.run catches to restore and go on."""
    try:
        yield
    except RanksLost as lost:
        _follow(group)
        raise RanksLostError(lost.failed, lost.size) from None
    except StructureMismatchError as exc:
        raise MismatchError(str(exc)).with_traceback(exc.__traceback__) from None
    except PeerError as exc:
        raise PeerFailure(exc).with_traceback(exc.__traceback__) from None


def shrink_job() -> List[int]:
    """After a rank was lost elsewhere (the optimizer's RanksLost): shrink
    the job's communicator to the survivors too (collective over them);
    returns the lost ranks."""
    group = _helper(global_process_set)
    lost = group.shrink()
    _follow(group)
    return lost


def _follow(group: MatchingGroup) -> None:
    """Make the survivors' group (after ``group`` shrank) the job's; other
    process sets are dropped."""
    for process_set in list(_job.sets.values()):
        if process_set is not global_process_set:
            _forget(process_set)
    global_process_set.table = Table(group, _take_part)    # what was posted is lost
    _set_world(group)


def _helper(process_set: ProcessSet) -> MatchingGroup:
    """The group of a registered ``process_set`` that holds this rank."""
    world()
    if process_set.process_set_id not in _job.sets:
        raise ValueError(f"{process_set} is not registered: hvd.add_process_set() it first")
    return process_set.joined()


# -- handles --------------------------------------------------------------------
class Handle(Posted):
    """A Horovod collective posted on a process set (matching.Posted), its
    errors Horovod's."""

    def test(self) -> bool:
        with _horovod_errors(self.table.group):
            return super().test()

    def wait(self) -> Any:
        with _horovod_errors(self.table.group):
            return super().wait()


def handle_of(posted: Handle) -> int:
    number = next(_job.next_handle)
    _job.handles[number] = posted
    return number


def _handle(handle: int) -> Handle:
    try:
        return _job.handles[handle]
    except KeyError:
        raise ValueError(f"handle {handle!r} is not an outstanding Horovod handle "
                         "(synchronized already?)") from None


def poll(handle: int) -> bool:
    """Whether the collective of ``handle`` has completed (where it is not
    matched yet, after one round of matching: see matching.Posted.test)."""
    return _handle(handle).test()


def synchronize(handle: int) -> Any:
    """Wait for the collective of ``handle``; return its result."""
    posted = _handle(handle)
    try:
        return posted.wait()
    finally:
        del _job.handles[handle]


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record the Horovod layer's collectives into ``file_path`` (Chrome's
    trace format, written by rank 0 of the job when the timeline stops)."""
    timeline.start(file_path, mark_cycles, writer=world().rank == 0)


def stop_timeline() -> None:
    """Write the timeline and stop recording."""
    timeline.stop()


# -- the checked post of every collective ----------------------------------------
def _describe(kind: str, name: Optional[str], process_set: ProcessSet,
              settings: Tuple[Tuple[str, Any], ...] = (),
              items: Tuple[str, ...] = (), recipe: Any = None) -> Description:
    """A Horovod call as every rank of its set must make it: its kind, its
    name, the set's ranks and the call's own ``settings`` (op, scale
    factors, root); ``recipe``: what a joined rank makes of it (compared
    last, after the items)."""
    common = (("name", name), ("process set", process_set.ranks))
    return Description(kind, tuple(sorted(common + settings)), items, noun="tensor",
                       agreed=() if recipe is None else (("recipe", recipe),))


def _post(process_set: ProcessSet, kind: str, name: Optional[str],
          describe: Callable[[], Description], post: Post) -> Handle:
    """Post one collective on ``process_set``: ``describe()`` (local checks;
    raises on bad input) returns what every rank must post alike under its
    name; ``post(group, joined)``, once every rank has posted it, starts the
    data moving (``joined``: some rank is in join()) and returns what it
    started and what finishes the call."""
    group = _helper(process_set)
    assert process_set.table is not None
    key: Key = process_set.table.key(kind, name)
    try:
        description, error = describe(), None
    except Exception as exc:
        description, error = None, exc
    posted = Handle(process_set.table, key, description, error, post)
    with _horovod_errors(group):
        process_set.table.post(posted)
    return posted


def join(process_set: ProcessSet = global_process_set) -> int:
    """This rank has no more data: take part in the others' allreduces with
    the op's identity until every rank has joined (any other collective
    meanwhile raises on the ranks that call it); return the rank that joined
    last (of the set)."""
    group = _helper(process_set)
    assert process_set.table is not None
    with _horovod_errors(group):
        return process_set.table.join()


def _take_part(group: MatchingGroup, description: Description) -> None:
    """A joined rank's part in the call ``description``: for an allreduce,
    the same Collective with the op's identity (zeros for a sum or an
    average, ones for a product, the largest value for a minimum, the
    smallest for a maximum), so that the others' result is theirs alone;
    nothing for the others (they raise on the calling ranks)."""
    if description.kind != "allreduce":
        return
    op, prescale, postscale, wire, fresh, apart, arrays = dict(description.agreed)["recipe"]
    if op == Adasum:                 # zeros leave the others' Adasum as it is
        sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape in arrays]
        adasum(group, np.zeros(sum(sizes)), sizes)
        return
    table = _TABLE_OPS[op]
    values = [np.full(shape, _joined_value(table, dtype_named(name), prescale),
                      dtype_named(name)) for name, shape in arrays]
    group.start(Collective(Kind.ALLREDUCE, "allreduce", tuple(values),
                           tuple(np.empty_like(v) for v in values) if apart else (),
                           op=table, prescale=prescale, postscale=postscale, wire=wire,
                           fresh=fresh)).complete()


@functools.lru_cache(maxsize=4096)
def _named(dtype: np.dtype, shape: Tuple[int, ...]) -> Tuple[str, Tuple[int, ...]]:
    """(dtype name, shape): an array as a joined rank's recipe names it (made once per
    dtype and shape: a dtype's name costs microseconds, a call has hundreds)."""
    return dtype.name, shape


def _joined_value(op: str, dtype: np.dtype, prescale: float) -> Any:
    """What a joined rank adds: the op's identity, as it is once prescaled."""
    value = identity(op, dtype)
    return dtype.type(value / prescale) if op == "prod" and dtype.kind == "f" else value


def _refuse_joined(group: MatchingGroup, joined: bool, what: str) -> None:
    """Every calling rank raises (the joined ranks go on in join())."""
    if joined:
        group.raise_agreed(RuntimeError(f"{what}: a rank has joined (hvd.join); only "
                                         "allreduce goes on until every rank has joined"))


def _check_op(op: int) -> None:
    if op not in _TABLE_OPS and op != Adasum:
        raise ValueError(f"op: expecting hvd.Average, Sum, Min, Max, Product or Adasum, "
                         f"got {op!r}")


def _check_adasum(arrays: Sequence[np.ndarray], process_set: ProcessSet) -> None:
    """Adasum's constraints, Horovod's: the global process set, a
    power-of-two number of ranks, floating point tensors."""
    if process_set is not global_process_set:
        raise NotImplementedError("op=hvd.Adasum: expecting the global process set (Horovod "
                                  f"supports no other), got {process_set}")
    size = world().size
    if size & (size - 1):
        raise NotImplementedError(f"op=hvd.Adasum: expecting a power-of-two number of ranks "
                                  f"(Horovod's binary tree of pairs), got {size}; use "
                                  "op=hvd.Average")
    for a in arrays:
        if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
            raise TypeError(f"op=hvd.Adasum: expecting floating point tensors, got {a.dtype}")


def _adasum_into(group: MatchingGroup, arrays: Sequence[np.ndarray],
                 outputs: Sequence[np.ndarray], prescale: float, postscale: float) -> None:
    """Adasum of ``arrays`` (prescaled) over ``group``'s ranks, postscaled
    into ``outputs`` (blocking)."""
    flat = np.concatenate([a.reshape(-1).astype(np.float64) * prescale for a in arrays]) \
        if arrays else np.zeros(0)
    combined = adasum(group, flat, [a.size for a in arrays]) * postscale
    offset = 0
    for a, out in zip(arrays, outputs):
        out[...] = combined[offset:offset + a.size].reshape(a.shape)
        offset += a.size


def _matched(group: MatchingGroup, spec: Collective) -> Tuple[List[Started], Finish]:
    """``spec`` started on ``group`` in a matched call (the round agreed on it):
    what it started and what finishes it."""
    pending = group.start(spec)
    return pending.started, pending.finish


# -- collectives on numpy arrays: each a translation onto a Collective ----------
def allreduce(arrays: Sequence[np.ndarray], outputs: Optional[Sequence[np.ndarray]], op: int,
              prescale: float, postscale: float, name: Optional[str],
              process_set: ProcessSet, compression: Optional[str] = None) -> Handle:
    """Reduce ``arrays`` (contiguous) over ``process_set`` into ``outputs`` (the
    same shapes and dtypes; may be the inputs; None: new arrays, the pending
    result), Horovod's way: prescaled, summed (or min, max, product), then
    averaged and postscaled (the collective layer's ALLREDUCE; integers
    averaged toward zero, half precision summed in float32, cast
    back). ``compression`` (a wire: "bfloat16", "float16", from
    Compression.bf16, fp16): float32 sums travel as it, summed in float32
    (mpigrad's wire)."""
    fresh = outputs is None
    apart = not fresh and not all(o is a for o, a in zip(outputs or (), arrays))
    items = tuple(array_item(a.dtype, a.shape) for a in arrays)
    specs: List[Collective] = []

    def describe() -> Description:
        _check_op(op)
        scales = (float(prescale), float(postscale))
        if op == Adasum:
            _check_adasum(arrays, process_set)
        else:
            check_op(_TABLE_OPS[op], (a.dtype for a in arrays), "allreduce", HOROVOD)
            specs.append(Collective(
                Kind.ALLREDUCE, "allreduce", tuple(arrays), tuple(outputs or ()) if apart else (),
                op=_TABLE_OPS[op], prescale=scales[0], postscale=scales[1],
                wire=compression if op in (Sum, Average) else None, fresh=fresh, items=items))
            _helper(process_set).check(specs[0])
        # a joined rank takes part with the op's identity in the same Collective
        recipe = (op, *scales, compression if op in (Sum, Average) else None, fresh, apart,
                  tuple(_named(a.dtype, a.shape) for a in arrays))
        return _describe("allreduce", name, process_set,
                         (("Horovod op", _OP_NAMES[op]), ("prescale_factor", scales[0]),
                          ("postscale_factor", scales[1]), ("wire", compression)),
                         items, recipe)

    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        if op == Adasum:
            results = [np.empty(a.shape, a.dtype) for a in arrays] if fresh else outputs
            assert results is not None
            _adasum_into(group, arrays, results, prescale, postscale)
            return [], lambda: results
        started, finish = _matched(group, specs[0])

        def finished() -> Any:
            made = finish()
            return made if fresh else (outputs if apart else arrays)
        return started, finished
    return _post(process_set, "allreduce", name, describe, post)


def _rows(arrays: Sequence[np.ndarray], name: str, op: str = "sum") -> Collective:
    """A row gather of ``arrays`` (every rank's rows, in rank order; with op
    "mean" the floating-point ones averaged: sparse values)."""
    return Collective(Kind.ALLGATHER, name, tuple(np.ascontiguousarray(a) for a in arrays),
                      op=op, items=tuple(f"{a.dtype.name}[*, {list(a.shape[1:])}]"
                                         for a in arrays))


def allgather(array: np.ndarray, name: Optional[str], process_set: ProcessSet) -> Handle:
    """Concatenate every rank's ``array`` along its first dimension (which may
    differ across ranks; the others must not); the pending result is (a new
    array of them, every rank's first dimension)."""
    spec = _rows([array], "allgather")

    def describe() -> Description:
        if array.ndim == 0:
            raise ValueError("allgather: expecting a tensor of at least one dimension, "
                             "got a scalar")
        return _describe("allgather", name, process_set, items=spec.items)

    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(group, joined, "allgather")
        started, finish = _matched(group, spec)

        def gathered() -> Tuple[np.ndarray, List[int]]:
            (output,), rows = finish()
            return output, rows
        return started, gathered
    return _post(process_set, "allgather", name, describe, post)


def sparse_allreduce(indices: np.ndarray, values: np.ndarray, dense_shape: Tuple[int, ...],
                     op: int, name: Optional[str], process_set: ProcessSet) -> Handle:
    """Reduce a sparse tensor of ``dense_shape`` (``indices``: [nnz, sparse
    dims] int64, ``values``: [nnz, ...]) over ``process_set`` as Horovod
    does: every rank's entries gathered (the row gather; duplicates add up),
    the values averaged for Average. The pending result is (indices, values)
    of them all."""
    spec = _rows([indices, values], "sparse_allreduce", "mean" if op == Average else "sum")

    def describe() -> Description:
        if op not in (Average, Sum):
            raise ValueError(f"sparse allreduce: expecting op=hvd.Average or hvd.Sum, got "
                             f"{_OP_NAMES.get(op, op)!r}")
        return _describe("sparse_allreduce", name, process_set,
                         (("op", _OP_NAMES[op]), ("dense shape", tuple(dense_shape))),
                         spec.items)

    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(group, joined, "sparse allreduce")
        started, finish = _matched(group, spec)
        return started, lambda: tuple(finish()[0])
    return _post(process_set, "sparse_allreduce", name, describe, post)


def broadcast(array: np.ndarray, root: int, name: Optional[str],
              process_set: ProcessSet) -> Handle:
    """``root``'s ``array`` into every rank's ``array`` (in place; contiguous);
    ``root``: a rank of the job in ``process_set``."""
    def describe() -> Description:
        process_set.root(root, "broadcast")
        return _describe("broadcast", name, process_set, (("root", int(root)),),
                         (array_item(array.dtype, array.shape),))

    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(group, joined, "broadcast")
        started, finish = _matched(group, Collective(
            Kind.BROADCAST, "broadcast", (array,), root=process_set.root(root, "broadcast")))
        return started, lambda: (finish(), array)[1]
    return _post(process_set, "broadcast", name, describe, post)


def broadcast_tree(tree: Any, root: int, process_set: ProcessSet,
                   name: Optional[str] = None) -> Any:
    """``root``'s (a rank of the job in ``process_set``) pytree of arrays and
    values on every rank of the set (arrays written in place where they can
    be: mpigrad.broadcast)."""
    return _blocking(process_set, "broadcast_parameters", name, lambda group: broadcast_on(
        group, tree, *_root_of(process_set, root, "broadcast_parameters")))


def broadcast_object(obj: Any, root: int, process_set: ProcessSet,
                     name: Optional[str] = None) -> Any:
    """``root``'s (a rank of the job in ``process_set``) picklable ``obj`` on
    every rank of the set."""
    return _blocking(process_set, "broadcast_object", name, lambda group: broadcast_object_on(
        group, obj, *_root_of(process_set, root, "broadcast_object")))


def allgather_object(obj: Any, process_set: ProcessSet, name: Optional[str] = None) -> List[Any]:
    """Every rank's picklable ``obj``, in the set's rank order."""
    gathered: List[Any] = _blocking(process_set, "allgather_object", name,
                                    lambda group: allgather_object_on(group, obj))
    return gathered


def _blocking(process_set: ProcessSet, kind: str, name: Optional[str],
              run: Callable[[MatchingGroup], Any]) -> Any:
    """A blocking collective of mpigrad's own (checked inside ``run``, over the
    set's Group, inside the matched call), posted and matched as the others are."""
    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(group, joined, kind)
        result = run(group)
        return [], lambda: result
    return _post(process_set, kind, name, lambda: _describe(kind, name, process_set),
                 post).wait()


def _root_of(process_set: ProcessSet, root: Any, what: str) -> Tuple[int, Optional[Exception]]:
    """(the set's rank of the job's rank ``root``, None), or (0, the error
    to raise on every rank) where it is not a rank of the set."""
    try:
        return process_set.root(root, what), None
    except ValueError as exc:
        return 0, exc


def _row_pieces(array: np.ndarray, rows: Sequence[int]) -> Tuple[np.ndarray, ...]:
    """``array``'s consecutive pieces of ``rows[r]`` rows each."""
    bounds = np.cumsum([0, *rows])
    return tuple(array[a:b] for a, b in zip(bounds[:-1], bounds[1:]))


def alltoall(array: np.ndarray, splits: Optional[Sequence[int]], name: Optional[str],
             process_set: ProcessSet) -> Handle:
    """Send ``splits[r]`` rows of ``array`` (first dimension, in order) to
    rank r (default: equal splits); the pending result is (a new array of the
    rows received from every rank in rank order, the received splits): the
    splits exchanged first (an ALLTOALL of one count per rank), then the rows."""
    def describe() -> Description:
        size = _helper(process_set).size
        rows = array.shape[0] if array.ndim else 0
        if splits is None:
            if rows % size:
                raise ValueError(f"alltoall: with no splits, expecting a first dimension "
                                 f"divisible by the {size} ranks, got {rows}")
        elif len(splits) != size or any(s < 0 for s in splits) or sum(splits) > rows:
            raise ValueError(f"alltoall: expecting {size} non-negative splits summing to at "
                             f"most the first dimension {rows}, got {list(splits)}")
        return _describe("alltoall", name, process_set,
                         items=(f"{array.dtype.name}[*, {list(array.shape[1:])}]",))

    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(group, joined, "alltoall")
        size = group.size
        sent = list(splits) if splits is not None else [array.shape[0] // size] * size
        counts = np.array(sent, np.int64)
        got = np.empty(size, np.int64)
        group.start(Collective(Kind.ALLTOALL, "alltoall splits", tuple(counts.reshape(-1, 1)),
                               tuple(got.reshape(-1, 1)))).complete()
        output = np.empty((int(got.sum()), *array.shape[1:]), array.dtype)
        data = np.ascontiguousarray(array)
        started, finish = _matched(group, Collective(
            Kind.ALLTOALL, "alltoall", _row_pieces(data, sent),
            _row_pieces(output, [int(g) for g in got])))
        return started, lambda: (finish(), (output, [int(g) for g in got]))[1]
    return _post(process_set, "alltoall", name, describe, post)


def reducescatter(arrays: Sequence[np.ndarray], op: int, prescale: float, postscale: float,
                  name: Optional[str], process_set: ProcessSet) -> Handle:
    """Sum (or average) each of ``arrays`` over the ranks; rank r receives rows
    [n r / p, ...) of the first dimension: the first n % p ranks one row
    more (Horovod's split): a REDUCE_SCATTER of each in those shares. The
    pending result is the list of new arrays."""
    def describe() -> Description:
        if op not in (Sum, Average):     # Horovod's own error class (a RuntimeError)
            raise HorovodInternalError(f"reducescatter: expecting op=hvd.Sum or hvd.Average, "
                                       f"got {_OP_NAMES.get(op, op)!r}")
        for a in arrays:
            if a.ndim == 0:
                raise ValueError("reducescatter: expecting tensors of at least one "
                                 "dimension, got a scalar")
        check_op(_TABLE_OPS[op], (a.dtype for a in arrays), "reducescatter", HOROVOD)
        return _describe("reducescatter", name, process_set,
                         (("op", _OP_NAMES[op]), ("prescale_factor", float(prescale)),
                          ("postscale_factor", float(postscale))),
                         tuple(array_item(a.dtype, a.shape) for a in arrays))

    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(group, joined, "reducescatter")
        size, rank = group.size, group.rank
        started: List[Started] = []
        finishes: List[Finish] = []
        outs = []
        for a in arrays:
            n, row = a.shape[0], int(np.prod(a.shape[1:], dtype=np.int64))
            rows = [n // size + (1 if r < n % size else 0) for r in range(size)]
            out = np.empty((rows[rank], *a.shape[1:]), a.dtype)
            more, finish = _matched(group, Collective(
                Kind.REDUCE_SCATTER, "reducescatter", (np.ascontiguousarray(a),), (out,),
                op=_TABLE_OPS[op], counts=tuple(r * row for r in rows),
                prescale=float(prescale), postscale=float(postscale)))
            started += more
            finishes.append(finish)
            outs.append(out)

        def finished() -> List[np.ndarray]:
            for finish in finishes:
                finish()
            return outs
        return started, finished
    return _post(process_set, "reducescatter", name, describe, post)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` gets here (the matched round
    itself: every rank of the set has posted it)."""
    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(group, joined, "barrier")
        return _matched(group, Collective(Kind.BARRIER, "barrier"))
    _post(process_set, "barrier", None, lambda: _describe("barrier", None, process_set),
          post).wait()

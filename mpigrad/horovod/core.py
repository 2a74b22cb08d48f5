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

import itertools
import os
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._base.description import Description
from .._base.dtypes import assign, message_dtype
from .._base.errors import PeerError, RanksLost, StructureMismatchError
from .._collective import Collective, Kind
from .._collective.matched import MatchingGroup, Placement, Started
from .._engine.world import is_communicator, world_rank
from .._engine.settle import rescaled
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
_MPI_OPS = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "prod"}


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank (Horovod's: a RuntimeError): the
    ranks called different collectives, or a peer's call failed; the cause
    (mpigrad's StructureMismatchError or PeerError) is chained."""


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
    except (StructureMismatchError, PeerError) as exc:
        raise HorovodInternalError(str(exc)) from exc


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
              items: Tuple[str, ...] = ()) -> Description:
    """A Horovod call as every rank of its set must make it: its kind, its
    name, the set's ranks and the call's own ``settings`` (op, scale
    factors, root)."""
    common = (("name", name), ("process set", process_set.ranks))
    return Description(kind, tuple(sorted(common + settings)), items, noun="tensor")


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
    the op's identity (zeros for a sum or an average, ones for a product,
    the largest value for a minimum, the smallest for a maximum), so that the
    others' result is theirs alone; nothing for the others (they raise on the
    calling ranks)."""
    settings = dict(description.settings)
    if description.kind != "allreduce":
        return
    if settings.get("engine") is not None:      # the engine's reduction, of zeros
        fresh, engine_op, arrays = settings["engine"]
        group.run(Collective(
            Kind.ALLREDUCE, "allreduce", tuple(np.zeros(shape, dtype) for dtype, shape in arrays),
            op=engine_op, fresh=fresh))
        return
    op = settings["op"]
    if op == "adasum":               # zeros leave the others' Adasum as it is
        sizes = [count for _, count in settings["messages"]]
        adasum(group, np.zeros(sum(sizes)), sizes)
        return
    for wire, count in settings["messages"]:
        identity = np.full(count, _identity(op, np.dtype(wire)))
        if _on_wire(settings.get("wire"), np.dtype(wire), op):
            group.sum_on_wire(identity, settings["wire"], "Allreduce for a joined rank")
        elif not _summed_by_engine(group, identity, op):
            group.allreduce(identity, op, "Allreduce for a joined rank")


def _engine_direct(group: MatchingGroup, arrays: Sequence[np.ndarray],
                   outputs: Optional[Sequence[np.ndarray]], op: int, prescale: float,
                   compression: Optional[str]) -> bool:
    """Whether an allreduce is the engine's reduction of the arrays themselves (in
    place, or into new arrays where ``outputs`` is None): a sum or average of
    float32 or float64 arrays (summed in their own dtype, scaled after as
    Horovod scales) that the engine takes, not prescaled nor compressed."""
    return (op in (Sum, Average) and prescale == 1.0 and compression is None and bool(arrays)
            and (outputs is None or all(o is a for o, a in zip(outputs, arrays)))
            and all(a.dtype in _OWN_WIRE and a.flags.c_contiguous for a in arrays)
            and group.takes_engine(Collective(Kind.ALLREDUCE, "allreduce", tuple(arrays))))


def _engine_op(op: int, postscale: float, size: int) -> str:
    """The engine's op for a Horovod sum or average over ``size`` ranks: its mean
    where that is Horovod's division exactly (no postscale, a power-of-two
    size: 1/size is exact), else the sum, scaled after."""
    return "mean" if op == Average and postscale == 1.0 and not size & (size - 1) else "sum"


#: the dtypes summed in their own precision (Horovod's scaling of the sum is then exact to
#: redo in place)
_OWN_WIRE = (np.dtype(np.float32), np.dtype(np.float64))


def _summed_by_engine(group: MatchingGroup, flat: np.ndarray, op: str) -> bool:
    """Sum ``flat`` in place through the engine where it takes the sum (a large
    floating-point one: node memory and cross-memory sums, the engine's own
    agreement; the same on every rank of a matched call, a joined one's
    identity included); whether it did."""
    spec = Collective(Kind.ALLREDUCE, "allreduce", (flat,), op=op)
    if op != "sum" or not group.takes_engine(spec):
        return False
    group.run(spec)
    return True


def _on_wire(wire: Optional[str], dtype: np.dtype, op: str) -> bool:
    """Whether a sum of ``dtype`` travels through ``wire`` (Compression.bf16/fp16: float32
    sums and averages)."""
    return wire is not None and dtype == np.float32 and op == "sum"


def _identity(op: str, dtype: np.dtype) -> Any:
    """The value of ``dtype`` that leaves a reduction by ``op`` unchanged."""
    if op in ("min", "max"):
        limits = np.finfo(dtype) if dtype.kind == "f" else np.iinfo(dtype)
        extreme = (np.inf if op == "min" else -np.inf) if dtype.kind == "f" else (
            limits.max if op == "min" else limits.min)
        return dtype.type(extreme)
    return dtype.type(1 if op == "prod" else 0)


def _refuse_joined(group: MatchingGroup, joined: bool, what: str) -> None:
    """Every calling rank raises (the joined ranks go on in join())."""
    if joined:
        group.raise_agreed(RuntimeError(f"{what}: a rank has joined (hvd.join); only "
                                         "allreduce goes on until every rank has joined"))


def _check_op(op: int) -> None:
    if op not in _MPI_OPS and op != Adasum:
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
    flat = np.concatenate([_prescaled(a, prescale).reshape(-1).astype(np.float64)
                           for a in arrays]) if arrays else np.zeros(0)
    combined = adasum(group, flat, [a.size for a in arrays])
    offset = 0
    for a, out in zip(arrays, outputs):
        _postscale(combined[offset:offset + a.size].reshape(a.shape), out, Sum, postscale,
                   group.size)
        offset += a.size


def _rounding(dtype: np.dtype, floor: bool = False) -> Optional[str]:
    """How a scaled value becomes one of ``dtype``: integers as torch's casts
    (toward zero) or its floor division (``floor``)."""
    if np.dtype(dtype).kind not in "iub":
        return None
    return "floor" if floor else "trunc"


def _postscale(summed: np.ndarray, out: np.ndarray, op: int, postscale: float,
               size: int) -> None:
    """Write ``summed`` (a reduction over ``size`` ranks, in its wire dtype)
    into ``out`` as Horovod finishes ``op``: a plain average divided
    (correctly rounded; an integer one as torch's floor division), else
    multiplied by the postscale factor (over ``size`` for an average)."""
    factor = postscale / size if op == Average else postscale
    if summed.dtype == out.dtype and out.dtype in _OWN_WIRE:   # rescaled's, in one pass
        if op == Average and postscale == 1.0:
            np.divide(summed, out.dtype.type(size), out=out)
        elif factor != 1.0:
            np.multiply(summed, out.dtype.type(factor), out=out)
        elif summed is not out:
            out[...] = summed
    elif op == Average and postscale == 1.0:
        assign(out, rescaled(summed, divisor=size, rounding=_rounding(out.dtype, floor=True)))
    else:
        assign(out, rescaled(summed, factor, rounding=_rounding(out.dtype)))


# -- collectives on numpy arrays ------------------------------------------------
def _prescaled(array: np.ndarray, factor: float) -> np.ndarray:
    """``array`` times ``factor`` as Horovod scales, cast back to its dtype."""
    if factor == 1.0:
        return array
    out = np.empty_like(array)
    assign(out, rescaled(array, factor, rounding=_rounding(array.dtype)))
    return out



def allreduce(arrays: Sequence[np.ndarray], outputs: Optional[Sequence[np.ndarray]], op: int,
              prescale: float, postscale: float, name: Optional[str],
              process_set: ProcessSet, compression: Optional[str] = None) -> Handle:
    """Reduce ``arrays`` (contiguous; fused: one message per wire dtype) over
    ``process_set`` into ``outputs`` (the same shapes and dtypes; may be the
    inputs; None: new arrays, the pending result), Horovod's way: prescaled,
    summed (or min, max, product), then averaged and postscaled, integers in
    float64 and half precision in float32, cast back. ``compression`` (a wire:
    "bfloat16", "float16", from Compression.bf16, fp16): float32 sums travel as
    it, summed in float32 (mpigrad's wire)."""
    groups: Dict[np.dtype, List[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(message_dtype(a.dtype, _MPI_OPS.get(op, "sum")), []).append(i)
    fresh = outputs is None
    direct = _engine_direct(_helper(process_set), arrays, outputs, op, prescale, compression)
    if outputs is None and not direct:
        outputs = [np.empty(a.shape, a.dtype) for a in arrays]

    def describe() -> Description:
        _check_op(op)
        if op == Adasum:
            _check_adasum(arrays, process_set)
        for a in arrays:
            if a.dtype.kind not in "biuf" and a.dtype.name != "bfloat16":
                raise TypeError(f"allreduce: expecting numeric tensors, got {a.dtype}")
            if a.dtype.kind == "b" and op in (Sum, Average):
                raise TypeError(f"allreduce of bool tensors: expecting op=hvd.Min (all), "
                                f"hvd.Max (any) or hvd.Product (all), got "
                                f"hvd.{_OP_NAMES[op]}; to count, cast to an integer dtype first")
        messages = tuple((w.str, sum(arrays[i].size for i in members))
                         for w, members in groups.items())
        if op == Adasum:             # a joined rank takes part with zeros of these sizes
            messages = tuple(("adasum", a.size) for a in arrays)
        # summed by the engine: a joined rank takes part with zeros of these arrays
        engine = (fresh, _engine_op(op, postscale, _helper(process_set).size),
                  tuple((a.dtype.str, a.shape) for a in arrays)) if direct else None
        return _describe("allreduce", name, process_set,
                         (("op", _MPI_OPS.get(op, "adasum")), ("Horovod op", _OP_NAMES[op]),
                          ("messages", messages), ("prescale_factor", float(prescale)),
                          ("postscale_factor", float(postscale)), ("wire", compression),
                          ("engine", engine)),
                         tuple(f"{a.dtype.name}{list(a.shape)}" for a in arrays))

    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        if direct:                   # the engine's reduction of the arrays themselves
            engine_op = _engine_op(op, postscale, group.size)
            summed = group.run(Collective(
                Kind.ALLREDUCE, "allreduce", tuple(arrays), op=engine_op, fresh=fresh))
            results = summed if fresh else arrays
            if engine_op == "sum":
                for out in results:
                    _postscale(out, out, op, postscale, group.size)
            return [], lambda: results
        assert outputs is not None
        if op == Adasum:
            _adasum_into(group, arrays, outputs, prescale, postscale)
            return [], lambda: outputs
        flats, started = {}, []
        for wire, members in groups.items():
            flat = np.concatenate([_prescaled(arrays[i], prescale).reshape(-1).astype(wire)
                                   for i in members])
            flats[wire] = flat
            what = (f"Allreduce ({_OP_NAMES[op]}) of {flat.nbytes} bytes"
                    + (f" named {name!r}" if name else ""))
            if compression is not None and _on_wire(compression, wire, _MPI_OPS[op]):
                group.sum_on_wire(flat, compression, what)
            elif not _summed_by_engine(group, flat, _MPI_OPS[op]):
                started.append(group.start_allreduce(flat, _MPI_OPS[op], what))
        def finish() -> Sequence[np.ndarray]:
            assert outputs is not None
            for wire, members in groups.items():
                offset = 0
                for i in members:
                    n = arrays[i].size
                    _postscale(flats[wire][offset:offset + n].reshape(arrays[i].shape),
                               outputs[i], op, postscale, group.size)
                    offset += n
            return outputs
        return started, finish
    return _post(process_set, "allreduce", name, describe, post)


def allgather(array: np.ndarray, name: Optional[str], process_set: ProcessSet) -> Handle:
    """Concatenate every rank's ``array`` along its first dimension (which may
    differ across ranks; the others must not); the pending result is (a new
    array of them, every rank's first dimension)."""
    def describe() -> Description:
        if array.ndim == 0:
            raise ValueError("allgather: expecting a tensor of at least one dimension, "
                             "got a scalar")
        return _describe("allgather", name, process_set,
                         items=(f"{array.dtype.name}[*, {list(array.shape[1:])}]",))

    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(group, joined, "allgather")
        rows = group.allgather_counts([array.shape[0]], "Allgather of first dimensions")[:, 0]
        row = int(np.prod(array.shape[1:], dtype=np.int64))
        output = np.empty((int(rows.sum()), *array.shape[1:]), array.dtype)
        started = group.start_allgatherv(np.ascontiguousarray(array).reshape(-1),
                                          [int(r) * row for r in rows], output.reshape(-1),
                                          f"Allgatherv of {array.dtype.name} rows")
        return [started], lambda: (output, [int(r) for r in rows])
    return _post(process_set, "allgather", name, describe, post)


def sparse_allreduce(indices: np.ndarray, values: np.ndarray, dense_shape: Tuple[int, ...],
                     op: int, name: Optional[str], process_set: ProcessSet) -> Handle:
    """Reduce a sparse tensor of ``dense_shape`` (``indices``: [nnz, sparse
    dims] int64, ``values``: [nnz, ...]; both contiguous) over
    ``process_set`` as Horovod does: every rank's entries gathered
    (Allgatherv; duplicates add up), the values averaged for Average. The
    pending result is (indices, values) of them all."""
    def describe() -> Description:
        if op not in (Average, Sum):
            raise ValueError(f"sparse allreduce: expecting op=hvd.Average or hvd.Sum, got "
                             f"{_OP_NAMES.get(op, op)!r}")
        return _describe("sparse_allreduce", name, process_set,
                         (("op", _OP_NAMES[op]), ("dense shape", tuple(dense_shape))),
                         (f"values {values.dtype.name}[*, {list(values.shape[1:])}]",
                          f"indices {indices.dtype.name}[*, {list(indices.shape[1:])}]"))

    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(group, joined, "sparse allreduce")
        counts = group.allgather_counts([indices.shape[0]], "Allgather of nonzero counts")[:, 0]
        total = int(counts.sum())
        all_indices = np.empty((total, *indices.shape[1:]), indices.dtype)
        gathered = np.empty((total, *values.shape[1:]), values.dtype)
        started = []
        for mine, out in ((indices, all_indices), (values, gathered)):
            row = int(np.prod(mine.shape[1:], dtype=np.int64))
            started.append(group.start_allgatherv(
                mine.reshape(-1), [int(c) * row for c in counts], out.reshape(-1),
                f"Allgatherv of sparse {'indices' if mine is indices else 'values'}"))

        def finish() -> Tuple[np.ndarray, np.ndarray]:
            averaged = np.empty_like(gathered)
            _postscale(gathered, averaged, op, 1.0, group.size)
            return all_indices, averaged
        return started, finish
    return _post(process_set, "sparse_allreduce", name, describe, post)


def broadcast(array: np.ndarray, root: int, name: Optional[str],
              process_set: ProcessSet) -> Handle:
    """``root``'s ``array`` into every rank's ``array`` (in place; contiguous);
    ``root``: a rank of the job in ``process_set``."""
    def describe() -> Description:
        process_set.root(root, "broadcast")
        return _describe("broadcast", name, process_set, (("root", int(root)),),
                         (f"{array.dtype.name}{list(array.shape)}",))

    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(group, joined, "broadcast")
        source = process_set.root(root, "broadcast")
        return [group.start_bcast(array, source, f"Bcast from rank {root}")], lambda: array
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


def alltoall(array: np.ndarray, splits: Optional[Sequence[int]], name: Optional[str],
             process_set: ProcessSet) -> Handle:
    """Send ``splits[r]`` rows of ``array`` (first dimension, in order) to
    rank r (default: equal splits); the pending result is (a new array of the
    rows received from every rank in rank order, the received splits)."""
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
        got = group.alltoall_counts(sent, "Alltoall of splits")
        row = int(np.prod(array.shape[1:], dtype=np.int64))
        output = np.empty((sum(got), *array.shape[1:]), array.dtype)
        started = group.start_alltoallv(np.ascontiguousarray(array).reshape(-1),
                                         [s * row for s in sent], output.reshape(-1),
                                         [g * row for g in got], "Alltoallv")
        return [started], lambda: (output, got)
    return _post(process_set, "alltoall", name, describe, post)


def reducescatter(arrays: Sequence[np.ndarray], op: int, prescale: float, postscale: float,
                  name: Optional[str], process_set: ProcessSet) -> Handle:
    """Sum (or average) each of ``arrays`` over the ranks; rank r receives rows
    [n r / p, ...) of the first dimension: the first n % p ranks one row
    more (Horovod's split). The pending result is the list of new arrays."""
    def describe() -> Description:
        if op not in (Sum, Average):     # Horovod's own error class (a RuntimeError)
            raise HorovodInternalError(f"reducescatter: expecting op=hvd.Sum or hvd.Average, "
                                       f"got {_OP_NAMES.get(op, op)!r}")
        for a in arrays:
            if a.ndim == 0:
                raise ValueError("reducescatter: expecting tensors of at least one "
                                 "dimension, got a scalar")
        return _describe("reducescatter", name, process_set,
                         (("op", _OP_NAMES[op]), ("prescale_factor", float(prescale)),
                          ("postscale_factor", float(postscale))),
                         tuple(f"{a.dtype.name}{list(a.shape)}" for a in arrays))

    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(group, joined, "reducescatter")
        size, rank = group.size, group.rank
        started, pieces = [], []
        for k, a in enumerate(arrays):
            n, row = a.shape[0], int(np.prod(a.shape[1:], dtype=np.int64))
            rows = [n // size + (1 if r < n % size else 0) for r in range(size)]
            send = _prescaled(a, prescale).reshape(-1).astype(message_dtype(a.dtype, "sum"))
            recv = np.empty(rows[rank] * row, send.dtype)
            started.append(group.start_reduce_scatter(
                send, recv, [r * row for r in rows], f"Reduce_scatter of tensor {k}"))
            pieces.append((send, recv, (rows[rank], *a.shape[1:])))
        def finish() -> List[np.ndarray]:
            outs = []
            for k, (_, recv, shape) in enumerate(pieces):
                out = np.empty(shape, arrays[k].dtype)
                _postscale(recv.reshape(shape), out, op, postscale, size)
                outs.append(out)
            return outs
        return started, finish
    return _post(process_set, "reducescatter", name, describe, post)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` gets here (watched)."""
    def post(group: MatchingGroup, joined: bool) -> Tuple[List[Started], Finish]:
        _refuse_joined(group, joined, "barrier")
        return [group.start_barrier("Barrier")], lambda: None
    _post(process_set, "barrier", None, lambda: _describe("barrier", None, process_set),
          post).wait()

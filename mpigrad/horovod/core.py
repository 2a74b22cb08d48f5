"""The framework-neutral core of Horovod's API on mpigrad: the job's state
(``init``, ranks, process sets), handles, and the checked, watched,
non-blocking collectives on numpy buffers that the torch layer wraps.

Every collective is one call of mpigrad's watched Communicator of its
process set: local checks, then the one tiny agreement (what every rank
calls: the op, dtypes, shapes, roots; a local error raises on every rank),
then the data moves as a non-blocking MPI call that ``synchronize`` waits on
under the watch. Ranks issue collectives in the same order (Horovod matches
them by name in a background thread; here they run in program order, which
every SPMD script already has). A rank in ``join()`` takes part in the
others' allreduces with zeros.
"""

import itertools
import pickle
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .._comm.communicator import Communicator, mpi_datatype
from .._comm.structure import fingerprint
from .._comm.ulfm import carry_on, is_process_failure, ulfm_problem
from .._base.dtypes import assign, wire_dtype
from .._base.errors import PeerError, StructureMismatchError

__all__ = ["HorovodInternalError", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ProcessSet",
           "global_process_set", "init", "shutdown", "is_initialized", "world",
           "add_process_set", "remove_process_set", "shrink_job", "Pending", "allreduce", "allgather",
           "broadcast", "alltoall", "reducescatter", "barrier", "join", "poll", "synchronize",
           "handle_of"]

# Horovod's ReduceOp values
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product"}
_MPI_OPS = {Average: MPI.SUM, Sum: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}

class HorovodInternalError(RuntimeError):
    """A collective failed on every rank (Horovod's: a RuntimeError): the
    ranks called different collectives, or a peer's call failed; the cause
    (mpigrad's StructureMismatchError or PeerError) is chained."""


_OPERATION = 1          # agreement bits: some rank calls a collective
_JOINED = 2             # some rank is in join()


class ProcessSet:
    """The ranks a collective runs among (Horovod's ``hvd.ProcessSet``):
    ``ProcessSet([0, 2])``, registered with ``add_process_set`` (or
    ``init(process_sets=...)``); ``global_process_set`` holds every rank."""

    def __init__(self, ranks: Optional[Sequence[int]] = None) -> None:
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.comm: Any = None                 # MPI.COMM_NULL where this rank is not in it
        self.process_set_id: Optional[int] = None
        self.helper: Any = None

    def included(self) -> bool:
        """Whether this rank belongs to the set."""
        return self.comm is not None and self.comm != MPI.COMM_NULL

    def size(self) -> int:
        return int(self.communicator().Get_size())

    def rank(self) -> int:
        return int(self.communicator().Get_rank())

    def communicator(self) -> Any:
        """The set's MPI communicator (ValueError where this rank is not in it)."""
        if not self.included():
            raise ValueError(f"this rank ({world().Get_rank()}) is not in {self}: expecting a "
                             "process set that holds it (hvd.add_process_set first)")
        return self.comm

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()


class _Job:
    """What init() sets up."""

    def __init__(self) -> None:
        self.comm: Any = None
        self.local: Any = None
        self.cross: Any = None
        self.sets: Dict[int, ProcessSet] = {}
        self.handles: Dict[int, "Pending"] = {}
        self.next_handle = itertools.count()
        self.next_set = itertools.count(1)


_job = _Job()


def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet]] = None) -> None:
    """Set up the job over ``comm`` (an mpi4py communicator, a list of
    ranks of COMM_WORLD, or None: COMM_WORLD); collective. Again: nothing."""
    if _job.comm is not None:
        return
    if comm is None:
        comm = MPI.COMM_WORLD
    elif isinstance(comm, (list, tuple)):
        group = MPI.COMM_WORLD.Get_group().Incl(list(comm))
        comm = MPI.COMM_WORLD.Create(group)
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"init: expecting an mpi4py communicator or a list of ranks, "
                        f"got {type(comm).__name__}")
    _set_world(comm)
    _register(global_process_set, comm, 0)
    for process_set in process_sets or ():
        add_process_set(process_set)


def shutdown() -> None:
    """Forget the job's state (MPI itself ends with the program)."""
    for process_set in list(_job.sets.values()):
        if process_set is not global_process_set:
            remove_process_set(process_set)
    _job.sets.clear()
    _job.handles.clear()
    _job.comm = None


def is_initialized() -> bool:
    return _job.comm is not None


def world() -> Any:
    """The job's communicator (ValueError before init)."""
    if _job.comm is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _job.comm


def local_comm() -> Any:
    world()
    return _job.local


def cross_comm() -> Any:
    world()
    return _job.cross


def _set_world(comm: Any) -> None:
    """Make ``comm`` the job's communicator (and the global set's), with its
    node-local and cross-node splits."""
    _job.comm = comm
    _job.local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    _job.cross = comm.Split(_job.local.Get_rank(), comm.Get_rank())
    global_process_set.comm = comm


def _forget(process_set: ProcessSet) -> None:
    """Unregister ``process_set`` (its communicator is freed or lost)."""
    assert process_set.process_set_id is not None
    del _job.sets[process_set.process_set_id]
    process_set.comm, process_set.helper, process_set.process_set_id = None, None, None


def _register(process_set: ProcessSet, comm: Any, number: int) -> ProcessSet:
    process_set.comm = comm
    process_set.process_set_id = number
    process_set.helper = (Communicator.helper(comm) if comm != MPI.COMM_NULL else None)
    _job.sets[number] = process_set
    return process_set


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks); collective
    over every rank of the job; returns it."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    comm = world()
    ranks = process_set.ranks
    if ranks is None or not ranks or any(not 0 <= r < comm.Get_size() for r in ranks):
        raise ValueError(f"add_process_set: expecting ranks in [0, {comm.Get_size()}), "
                         f"got {ranks}")
    mine = comm.Get_rank() in ranks
    sub = comm.Split(0 if mine else MPI.UNDEFINED, comm.Get_rank())
    return _register(process_set, sub, next(_job.next_set))


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (not the global one); collective."""
    if process_set is global_process_set or process_set.process_set_id not in _job.sets:
        return False
    if process_set.included():
        process_set.comm.Free()
    _forget(process_set)
    return True


@contextmanager
def _surviving(helper: Communicator) -> Iterator[None]:
    """A lost rank inside the block: in a job launched with fault tolerance
    (ULFM), the survivors shrink the job to themselves (hvd.rank() and
    size() change; process sets other than the global one are dropped) and
    raise HorovodInternalError, which hvd.elastic.run catches to restore and
    go on; else the error as it is."""
    try:
        yield
    except MPI.Exception as exc:
        if ulfm_problem() is not None or not is_process_failure(exc, helper.comm):
            raise
        lost = _shrink(helper)
        raise HorovodInternalError(f"rank(s) {lost} of the job were lost; the {helper.size} "
                                   "survivors go on (hvd.elastic.run restores the last "
                                   "commit)") from None


def shrink_job() -> List[int]:
    """After a rank was lost elsewhere (the optimizer's RanksLost): shrink
    the job's communicator to the survivors too (collective over them);
    returns the lost ranks."""
    return _shrink(global_process_set.helper)


def _shrink(helper: Communicator) -> List[int]:
    """Move ``helper`` to the survivors (collective over them) and make
    their communicator the job's; other process sets are dropped. Returns
    the lost ranks."""
    lost = carry_on(helper.comm, helper.rejoin, helper.timeout)
    for process_set in list(_job.sets.values()):
        if process_set is not global_process_set:
            _forget(process_set)
    _set_world(helper.comm.Dup())
    return lost


def _helper(process_set: ProcessSet) -> Communicator:
    world()
    if process_set.process_set_id not in _job.sets:
        raise ValueError(f"{process_set} is not registered: hvd.add_process_set() it first")
    process_set.communicator()
    return process_set.helper


# -- handles --------------------------------------------------------------------
class Pending:
    """A collective in flight: its MPI requests and what finishes it."""

    def __init__(self, helper: Communicator, requests: List[Tuple[Any, str]],
                 finish: Callable[[], Any], name: Optional[Tuple[str, str]]) -> None:
        self.helper, self.requests, self.finish, self.name = helper, requests, finish, name
        self.result: Any = None
        self.done = False

    def then(self, fn: Callable[[Any], Any]) -> "Pending":
        """Finish with ``fn`` of what the call gives (say, as torch tensors)."""
        finish = self.finish
        self.finish = lambda: fn(finish())
        return self

    def test(self) -> bool:
        """Whether the data has moved (does not finish)."""
        return self.done or all(request.Test() for request, _ in self.requests)

    def wait(self) -> Any:
        if not self.done:
            with _surviving(self.helper), self.helper.call(begin=False):
                for request, what in self.requests:
                    self.helper.wait(request, what)
                self.result = self.finish()
            self.done = True
        return self.result


def handle_of(pending: Pending) -> int:
    number = next(_job.next_handle)
    _job.handles[number] = pending
    return number


def _pending(handle: int) -> Pending:
    try:
        return _job.handles[handle]
    except KeyError:
        raise ValueError(f"handle {handle!r} is not an outstanding Horovod handle "
                         "(synchronized already?)") from None


def poll(handle: int) -> bool:
    """Whether the collective of ``handle`` has completed (non-blocking)."""
    return _pending(handle).test()


def synchronize(handle: int) -> Any:
    """Wait for the collective of ``handle``; return its result."""
    pending = _pending(handle)
    try:
        return pending.wait()
    finally:
        del _job.handles[handle]


def _names_in_flight(helper: Communicator) -> set:
    """The (kind, name) of this process set's collectives not yet
    synchronized (Horovod's names live per kind: allreduce.x, allgather.x)."""
    return {p.name for p in _job.handles.values()
            if p.helper is helper and not p.done and p.name is not None}


# -- the checked start of every collective --------------------------------------
def _start(process_set: ProcessSet, kind: str, name: Optional[str], describe: Callable[[], Any],
           post: Callable[[Communicator, bool], Tuple[List[Tuple[Any, str]], Callable[[], Any]]],
           ) -> Pending:
    """One collective: ``describe()`` (local checks; raises on bad input)
    returns what every rank must agree on; ``post(helper, joined)`` starts
    the data moving (``joined``: some rank is in join()) and returns the
    requests and what finishes the call."""
    helper = _helper(process_set)
    with _surviving(helper), helper.call(completes=False):
        error, description = None, None
        try:
            if name is not None and (kind, name) in _names_in_flight(helper):
                raise ValueError(f"an {kind} named {name!r} is already in flight; "
                                 "synchronize it first or use another name")
            description = describe()
        except Exception as exc:    # any local error: raised on every rank
            error = exc
        try:
            _, bits = helper.agree(error, fingerprint(description) if description else 0,
                                   lambda: description, bits=_OPERATION)
        except (StructureMismatchError, PeerError) as exc:
            raise HorovodInternalError(str(exc)) from exc
        if bits & _JOINED:
            _tell_joined(helper, description)
        requests, finish = post(helper, bool(bits & _JOINED))
    return Pending(helper, requests, finish, None if name is None else (kind, name))


def _tell_joined(helper: Communicator, description: Any = None, joined: bool = False) -> Any:
    """Some rank is in join(): the lowest rank not in it tells every rank the
    call it makes (collective: the calling ranks pass ``description``, the
    joined ones ``joined=True``); returns that call's description."""
    data = np.frombuffer(b"" if joined else pickle.dumps(description), np.uint8)
    counts = helper.allgather_counts([0 if joined else 1], "Allgather of who joined")
    root = int(np.flatnonzero(counts[:, 0])[0])
    size = np.array([data.size], np.int64)
    helper.collective("Bcast", ([size, MPI.INT64_T], root), "Bcast of a call's size for join")
    buf = data.copy() if helper.rank == root else np.empty(int(size[0]), np.uint8)
    helper.bcast_bytes(buf, root, "Bcast of a call for the joined ranks")
    return pickle.loads(buf.tobytes())


def join(process_set: ProcessSet = global_process_set) -> int:
    """This rank has no more data: take part in the others' allreduces with
    zeros until every rank has joined (an allgather, broadcast, alltoall or
    reducescatter meanwhile raises on the ranks that call it); return the
    rank that joined last."""
    helper = _helper(process_set)
    rounds = 0
    with _surviving(helper), helper.call():
        while True:
            rounds += 1
            # the largest extra: the fewest rounds in join() (the last to
            # join), then the highest rank
            last, bits = helper.agree(None, 0, lambda: ((("joined", True),), ()),
                                      extra=((1 << 40) - rounds) * helper.size + helper.rank,
                                      bits=_JOINED, absent=True)
            if not bits & _OPERATION:
                return last % helper.size
            _take_part(helper, _tell_joined(helper, joined=True))


def _take_part(helper: Communicator, description: Any) -> None:
    """A joined rank's part in the call ``description``: zeros for an
    allreduce; nothing for the others (they raise on the calling ranks)."""
    settings = dict(description[0])
    if settings.get("kind") != "allreduce":
        return
    for wire, count in settings["messages"]:
        zeros = np.zeros(count, np.dtype(wire))
        helper.collective("Allreduce", (MPI.IN_PLACE, [zeros, mpi_datatype(zeros.dtype)],
                                        _MPI_OPS[settings["op"]]), "Allreduce for a joined rank")


def _refuse_joined(joined: bool, what: str) -> None:
    if joined:
        raise RuntimeError(f"{what}: a rank has joined (hvd.join); only allreduce goes on "
                           "until every rank has joined")


def _check_op(op: int) -> None:
    if op == Adasum:
        raise NotImplementedError("op=Adasum is not supported by mpigrad's Horovod layer; "
                                  "use op=hvd.Average (the mean)")
    if op not in _MPI_OPS:
        raise ValueError(f"op: expecting hvd.Average, Sum, Min, Max or Product, got {op!r}")


# -- collectives on numpy arrays ------------------------------------------------
def _scaled(array: np.ndarray, factor: float) -> np.ndarray:
    """``array`` times ``factor`` as Horovod scales: integers in float64,
    half precision in float32, cast back to the dtype."""
    if factor == 1.0:
        return array
    math = np.dtype(np.float64 if array.dtype.kind in "iub"
                    else np.float32 if array.dtype.itemsize == 2 else array.dtype)
    out = np.empty_like(array)
    values = array.astype(math) * math.type(factor)
    assign(out, _cast(values, out.dtype) if out.dtype.kind in "iub" else values)
    return out


def allreduce(arrays: Sequence[np.ndarray], outputs: Sequence[np.ndarray], op: int,
              prescale: float, postscale: float, name: Optional[str],
              process_set: ProcessSet) -> Pending:
    """Reduce ``arrays`` (contiguous; fused: one message per wire dtype) over
    ``process_set`` into ``outputs`` (the same shapes and dtypes; may be the
    inputs), Horovod's way: prescaled, summed (or min, max, product), then
    averaged and postscaled, integers in float64 and half precision in
    float32, cast back."""
    wires = [wire_dtype(a.dtype) if a.dtype.kind == "f" or a.dtype.name == "bfloat16"
             else a.dtype for a in arrays]
    groups: Dict[np.dtype, List[int]] = {}
    for i, wire in enumerate(wires):
        groups.setdefault(np.dtype(wire), []).append(i)

    def describe() -> Any:
        _check_op(op)
        for a in arrays:
            if a.dtype.kind not in "biuf" and a.dtype.name != "bfloat16":
                raise TypeError(f"allreduce: expecting numeric tensors, got {a.dtype}")
        messages = tuple((w.str, sum(arrays[i].size for i in members))
                         for w, members in groups.items())
        return ((("kind", "allreduce"), ("op", op), ("messages", messages)),
                tuple(f"{a.dtype.name}{list(a.shape)}" for a in arrays))

    def post(helper: Communicator, joined: bool) -> Tuple[List[Tuple[Any, str]], Callable]:
        flats, requests = {}, []
        for wire, members in groups.items():
            flat = np.concatenate([_scaled(arrays[i], prescale).reshape(-1).astype(wire)
                                   for i in members]) if members else np.empty(0, wire)
            flats[wire] = flat
            requests.append((helper.comm.Iallreduce(MPI.IN_PLACE, [flat, mpi_datatype(wire)],
                                                    _MPI_OPS[op]),
                             f"Allreduce ({_OP_NAMES[op]}) of {flat.nbytes} bytes"
                             + (f" named {name!r}" if name else "")))
        factor = postscale / helper.size if op == Average else postscale
        # a plain average divides (an integer one as torch's floor division)
        floor = op == Average and postscale == 1.0

        def finish() -> Sequence[np.ndarray]:
            for wire, members in groups.items():
                offset = 0
                for i in members:
                    n = arrays[i].size
                    part = flats[wire][offset:offset + n].reshape(arrays[i].shape)
                    offset += n
                    if floor:         # divided, correctly rounded, as Horovod's tests compare
                        math = np.dtype(np.float64 if wire.kind in "iub" else wire)
                        part = part.astype(math) / math.type(helper.size)
                    elif factor != 1.0:
                        math = np.dtype(np.float64 if wire.kind in "iub" else wire)
                        part = part.astype(math) * math.type(factor)
                    target = outputs[i]
                    assign(target, _cast(part, target.dtype, floor=floor)
                           if target.dtype.kind in "iub" else part)
            return outputs
        return requests, finish
    return _start(process_set, "allreduce", name, describe, post)


def _cast(values: np.ndarray, dtype: np.dtype, floor: bool = False) -> np.ndarray:
    """``values`` in ``dtype``: integers truncated toward zero, as torch's
    casts (``floor``: rounded down, as an integer average divides)."""
    if np.dtype(dtype).kind in "iub" and values.dtype.kind == "f":
        return (np.floor(values) if floor else np.trunc(values)).astype(dtype)
    return values.astype(dtype)


def allgather(array: np.ndarray, name: Optional[str], process_set: ProcessSet) -> Pending:
    """Concatenate every rank's ``array`` along its first dimension (which may
    differ across ranks; the others must not); the pending result is (a new
    array of them, every rank's first dimension)."""
    def describe() -> Any:
        if array.ndim == 0:
            raise ValueError("allgather: expecting a tensor of at least one dimension, "
                             "got a scalar")
        return ((("kind", "allgather"),), (f"{array.dtype.name}[*, {list(array.shape[1:])}]",))

    def post(helper: Communicator, joined: bool) -> Tuple[List[Tuple[Any, str]], Callable]:
        _refuse_joined(joined, "allgather")
        rows = helper.allgather_counts([array.shape[0]], "Allgather of first dimensions")[:, 0]
        row = int(np.prod(array.shape[1:], dtype=np.int64))
        output = np.empty((int(rows.sum()), *array.shape[1:]), array.dtype)
        counts = [int(r) * row for r in rows]
        displs = np.cumsum([0] + counts[:-1]).tolist()
        datatype = mpi_datatype(_mpi_view(array).dtype)
        request = helper.comm.Iallgatherv(
            [_mpi_view(np.ascontiguousarray(array)), datatype],
            [_mpi_view(output), (counts, displs), datatype])
        return ([(request, f"Allgatherv of {array.dtype.name} rows")],
                lambda: (output, [int(r) for r in rows]))
    return _start(process_set, "allgather", name, describe, post)


def _mpi_view(array: np.ndarray) -> np.ndarray:
    """``array`` as MPI can move it: half precision and bools as bytes."""
    if array.dtype.itemsize == 2 and array.dtype.kind == "f" or array.dtype.name == "bfloat16":
        return array.view(np.uint16)
    if array.dtype == np.bool_:
        return array.view(np.uint8)
    return array


def broadcast(array: np.ndarray, root: int, name: Optional[str],
              process_set: ProcessSet) -> Pending:
    """``root``'s ``array`` into every rank's ``array`` (in place; contiguous)."""
    def describe() -> Any:
        size = _helper(process_set).size
        if not isinstance(root, (int, np.integer)) or not 0 <= root < size:
            raise ValueError(f"broadcast: expecting a root rank in [0, {size}), got {root!r}")
        return ((("kind", "broadcast"), ("root", int(root))),
                (f"{array.dtype.name}{list(array.shape)}",))

    def post(helper: Communicator, joined: bool) -> Tuple[List[Tuple[Any, str]], Callable]:
        _refuse_joined(joined, "broadcast")
        view = _mpi_view(array)
        request = helper.comm.Ibcast([view, mpi_datatype(view.dtype)], int(root))
        return [(request, f"Bcast from rank {root}")], lambda: array
    return _start(process_set, "broadcast", name, describe, post)


def alltoall(array: np.ndarray, splits: Optional[Sequence[int]], name: Optional[str],
             process_set: ProcessSet) -> Pending:
    """Send ``splits[r]`` rows of ``array`` (first dimension, in order) to
    rank r (default: equal splits); the pending result is (a new array of the
    rows received from every rank in rank order, the received splits)."""
    def describe() -> Any:
        size = _helper(process_set).size
        rows = array.shape[0] if array.ndim else 0
        if splits is None:
            if rows % size:
                raise ValueError(f"alltoall: with no splits, expecting a first dimension "
                                 f"divisible by the {size} ranks, got {rows}")
        elif len(splits) != size or any(s < 0 for s in splits) or sum(splits) > rows:
            raise ValueError(f"alltoall: expecting {size} non-negative splits summing to at "
                             f"most the first dimension {rows}, got {list(splits)}")
        return ((("kind", "alltoall"),), (f"{array.dtype.name}[*, {list(array.shape[1:])}]",))

    def post(helper: Communicator, joined: bool) -> Tuple[List[Tuple[Any, str]], Callable]:
        _refuse_joined(joined, "alltoall")
        size = helper.size
        send = list(splits) if splits is not None else [array.shape[0] // size] * size
        sent = np.array(send, np.int64)
        got = np.empty(size, np.int64)
        helper.collective("Alltoall", ([sent, MPI.INT64_T], [got, MPI.INT64_T]),
                          "Alltoall of splits")
        row = int(np.prod(array.shape[1:], dtype=np.int64))
        output = np.empty((int(got.sum()), *array.shape[1:]), array.dtype)
        scounts, rcounts = [int(s) * row for s in sent], [int(g) * row for g in got]
        sdispls = np.cumsum([0] + scounts[:-1]).tolist()
        rdispls = np.cumsum([0] + rcounts[:-1]).tolist()
        view = _mpi_view(np.ascontiguousarray(array))
        datatype = mpi_datatype(view.dtype)
        request = helper.comm.Ialltoallv([view, (scounts, sdispls), datatype],
                                         [_mpi_view(output), (rcounts, rdispls), datatype])
        return ([(request, "Alltoallv")], lambda: (output, [int(g) for g in got]))
    return _start(process_set, "alltoall", name, describe, post)


def reducescatter(arrays: Sequence[np.ndarray], op: int, prescale: float, postscale: float,
                  name: Optional[str], process_set: ProcessSet) -> Pending:
    """Sum (or average) each of ``arrays`` over the ranks; rank r receives rows
    [n r / p, ...) of the first dimension: the first n % p ranks one row
    more (Horovod's split). The pending result is the list of new arrays."""
    def describe() -> Any:
        if op not in (Sum, Average):
            _check_op(op)
            raise ValueError("reducescatter: expecting op=hvd.Sum or hvd.Average")
        for a in arrays:
            if a.ndim == 0:
                raise ValueError("reducescatter: expecting tensors of at least one "
                                 "dimension, got a scalar")
        return ((("kind", "reducescatter"), ("op", op)),
                tuple(f"{a.dtype.name}{list(a.shape)}" for a in arrays))

    def post(helper: Communicator, joined: bool) -> Tuple[List[Tuple[Any, str]], Callable]:
        _refuse_joined(joined, "reducescatter")
        size, rank = helper.size, helper.rank
        requests, pieces = [], []
        for k, a in enumerate(arrays):
            n, row = a.shape[0], int(np.prod(a.shape[1:], dtype=np.int64))
            rows = [n // size + (1 if r < n % size else 0) for r in range(size)]
            wire = np.dtype(wire_dtype(a.dtype) if a.dtype.kind == "f" else a.dtype)
            send = _scaled(a, prescale).reshape(-1).astype(wire)
            recv = np.empty(rows[rank] * row, wire)
            requests.append((helper.comm.Ireduce_scatter(
                [send, mpi_datatype(wire)], [recv, mpi_datatype(wire)],
                [r * row for r in rows], MPI.SUM), f"Reduce_scatter of tensor {k}"))
            pieces.append((send, recv, (rows[rank], *a.shape[1:])))
        factor = postscale / size if op == Average else postscale

        def finish() -> List[np.ndarray]:
            outs = []
            for k, (_, recv, shape) in enumerate(pieces):
                values = recv.reshape(shape)
                if factor != 1.0:
                    math = np.dtype(np.float64 if values.dtype.kind in "iub" else values.dtype)
                    values = values.astype(math) * math.type(factor)
                out = np.empty(shape, arrays[k].dtype)
                assign(out, _cast(values, out.dtype, floor=op == Average and postscale == 1.0)
                       if out.dtype.kind in "iub" else values)
                outs.append(out)
            return outs
        return requests, finish
    return _start(process_set, "reducescatter", name, describe, post)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` gets here (watched)."""
    def post(helper: Communicator, joined: bool) -> Tuple[List[Tuple[Any, str]], Callable]:
        _refuse_joined(joined, "barrier")
        return [(helper.comm.Ibarrier(), "Barrier")], lambda: None
    _start(process_set, "barrier", None, lambda: ((("kind", "barrier"),), ()), post).wait()

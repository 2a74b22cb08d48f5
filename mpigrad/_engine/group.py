"""The one typed collective: what a face asks of a group of ranks
(``Collective``), and the one entry that runs it (``Group.run``).

A face translates its API into a Collective (the kind, the op, this rank's
arrays in and out, the root, the names and values the ranks must share) and
hands it to its Group. The Group makes the call's one agreement (the
Collective's Description: a rank that asks for something else, or whose
local checks failed, raises on every rank before any data moves), then moves
the data: a floating-point sum or mean of ``ENGINE_BYTES`` or more (every
float sum where MPIGRAD_REPRODUCIBLE=1) is a reduction of the group's engine
(node memory, cross-memory, exact or wire sums: the Reducer's own path, whose
agreement is then the call's one), anything else is packed per wire dtype
(half precision summed in float32, bools as bytes, integers as they are) into
one MPI operation each, and a mean is the engine's one mean. Every face that
asks for the same sum gets the same bits.

A face never holds a communicator: it holds a Group (made over MPI's world, a
caller's mpi4py communicator, a split of the world by ranks, or a Reducer's
own communicator) and asks it for its rank, size, subgroups and
point-to-point messages.
"""

import enum
import time
import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from mpi4py import MPI

from .._base.dtypes import message_dtype
from .._base.settings import Settings, reproducible_setting
from .._base.errors import StructureMismatchError
from .._comm.checked import checked
from .._comm.communicator import Communicator
from .._base.description import Description, Pairs
from .._comm.tally import Statistics, statistics
from .buffers import check_no_aliasing
from .engine import Engine
from .settle import mean_factor, settle

__all__ = ["Kind", "Collective", "Request", "Group", "Message", "ENGINE_BYTES", "Statistics",
           "statistics"]

#: sums of at least this many bytes go to the engine (node sums pay off from
#: there); smaller ones are one MPI operation per wire dtype after the agreement
ENGINE_BYTES = 1 << 16

#: the ops a reduction takes, by name (a mean is a sum, then the one mean)
OPS = ("sum", "mean", "max", "min", "prod", "band", "bor", "bxor")


class Kind(enum.Enum):
    """What a Collective does with its arrays (see Collective)."""

    ALLREDUCE = "allreduce"
    REDUCE = "reduce"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    ALLGATHER = "allgather"
    GATHER = "gather"
    SCATTER = "scatter"
    ALLTOALL = "alltoall"
    BARRIER = "barrier"


def _reduces(kind: "Kind") -> bool:
    """Whether collectives of ``kind`` reduce with an op."""
    return kind in (Kind.ALLREDUCE, Kind.REDUCE, Kind.REDUCE_SCATTER)


@dataclass(frozen=True)
class Collective:
    """One typed collective, as a face asks for it.

    Args:
        kind: what it does:
            ALLREDUCE: ``recvs[i]`` (default: ``sends[i]``, in place) gets
            ``op`` of every rank's ``sends[i]``; REDUCE: the same on ``root``
            only; BROADCAST: ``root``'s ``sends`` overwrite every rank's, and
            root's ``payload`` comes back; ALLGATHER: every rank's ``sends[0]``
            into ``recvs`` in rank order (one array per rank, or one of them
            all), or with a ``payload`` every rank's payload (any sizes);
            GATHER: the same into root's ``recvs`` only; SCATTER: root's
            ``sends`` (one per rank) into each rank's ``recvs[0]``; ALLTOALL:
            ``sends[r]`` to rank r, ``recvs[r]`` from it; BARRIER: nothing.
        name: the face's call, as the agreement and reports name it.
        sends: this rank's arrays in (host numpy, C-contiguous).
        recvs: where results go (host numpy, C-contiguous, writeable).
        op: a reduction's op, one of OPS ("mean": the sum, then the mean).
        root: the root rank of REDUCE, BROADCAST, GATHER and SCATTER.
        items: one line per array, compared across ranks (dtypes and shapes).
        settings: more (name, value) pairs every rank must share.
        structure: the caller's tree structure, compared across ranks.
        payload: BROADCAST: root's bytes; ALLGATHER: this rank's bytes.
        fresh: ALLREDUCE: the results in new arrays, which ``run`` returns
            (``sends`` stay as they are).
        noun: what an item is called in a mismatch report.
    """

    kind: Kind
    name: str
    sends: Tuple[np.ndarray, ...] = ()
    recvs: Tuple[np.ndarray, ...] = ()
    op: str = "sum"
    root: Optional[int] = None
    items: Tuple[str, ...] = ()
    settings: Pairs = ()
    structure: Optional[str] = None
    payload: Optional[bytes] = None
    fresh: bool = False
    noun: str = field(default="tensor", compare=False)

    def describe(self) -> Description:
        """What every rank must do alike: the call, its op and root, its items."""
        settings = self.settings
        if _reduces(self.kind):
            settings = (("op", self.op),) + settings
        if self.root is not None:
            settings = settings + (("root", self.root),)
        return Description(self.name, settings, self.items, self.structure, noun=self.noun)

    @property
    def outputs(self) -> Tuple[np.ndarray, ...]:
        """A reduction's outputs: ``recvs``, else ``sends`` (in place)."""
        return self.recvs or self.sends


#: a face's request: a Collective, or the local error that kept it from making one
#: (raised on this rank, PeerError on the others, in the agreement)
Request = Union[Collective, Exception]


class Group:
    """A group of ranks the faces run typed collectives on.

    Args:
        communicator: its Communicator (made for it: ``Group.over``, or a
            Reducer's or a helper's, which it borrows).
        owned: whether ``free`` frees the communicator.
        point_to_point: whether sends and receives are offered (a split of
            their own, made now: collective).
        calls: what brackets each of its calls (default: the communicator's
            ``call``; a Reducer's group: the Reducer's, which also follows a
            shrink; a MatchingGroup's: nothing, its caller is inside one).
        engine: the Engine its floating-point sums and means go to: a
            Reducer's own (every such sum, whatever its size: the Reducer's
            settings give its bits); default one of the group's, made with
            the default settings at its first sum of ``ENGINE_BYTES`` or more.
    """

    def __init__(self, communicator: Communicator, owned: bool = False,
                 point_to_point: bool = False,
                 calls: Optional[Callable[[], AbstractContextManager[Any]]] = None,
                 engine: Optional[Engine] = None) -> None:
        self.communicator = communicator
        self.owned = owned
        self.calls = calls or communicator.call
        self.engine = engine
        self.owns_engine = engine is None
        self.engine_bytes = ENGINE_BYTES if engine is None else 0
        self.p2p: Optional[MPI.Intracomm] = None
        if point_to_point:
            with communicator.call():
                self.open_point_to_point()

    @classmethod
    def over(cls, comm: Optional[Any] = None, timeout: Optional[float] = None,
             point_to_point: bool = False, on_stall: str = "abort") -> "Group":
        """A Group of its own over ``comm`` (an mpi4py intracommunicator;
        default MPI's world), duplicated (collective); ``on_stall``: see
        Communicator."""
        return cls(Communicator(comm, timeout=timeout, on_stall=on_stall), owned=True,
                   point_to_point=point_to_point)

    @classmethod
    def shared(cls, comm: Optional[Any] = None, timeout: Optional[float] = None) -> "Group":
        """The Group that mpigrad's functions share on ``comm`` (made on the
        first call, collectively; kept with the caller's communicator)."""
        helper = Communicator.helper(comm, timeout)
        group = _SHARED.get(helper)
        if group is None:
            group = _SHARED[helper] = cls(helper)
        return group

    @property
    def rank(self) -> int:
        return self.communicator.rank

    @property
    def size(self) -> int:
        return self.communicator.size

    @property
    def freed(self) -> bool:
        return self.communicator.freed

    @property
    def comm(self) -> Any:
        """The group's private mpi4py communicator (for a user who asks)."""
        return self.communicator.comm

    def subgroup(self, ranks: Sequence[int], timeout: Optional[float]) -> "Group":
        """A Group of ``ranks`` of this one (collective over them only: the
        others need not call), with point-to-point messages. MPI's
        Comm_create_group: members that name different ranks stall."""
        return Group.over(self.communicator.create_group(ranks), timeout, point_to_point=True,
                          on_stall=self.communicator.on_stall)

    def split_ranks(self, ranks: Sequence[int], timeout: Optional[float]) -> Optional["Group"]:
        """A Group of ``ranks`` of this one, in that order, with point-to-point
        messages; None on the ranks not in it. Collective over this group:
        every rank names the same ``ranks`` (agreed first: a rank that names
        others raises on every rank), then the members split off (watched)."""
        with self.calls(), checked(self.communicator) as call:
            members = [int(r) for r in ranks]
            if len(set(members)) != len(members) or \
                    not all(0 <= r < self.size for r in members):
                raise ValueError(f"new_group: expecting distinct ranks in [0, {self.size}), "
                                 f"got {list(ranks)}")
            call.propose(Description("new_group", (("ranks", tuple(members)),)))
            member = self.rank in members
            part = self.communicator.split(
                f"new_group({members})", color=0 if member else MPI.UNDEFINED,
                key=members.index(self.rank) if member else 0)
        return Group.over(part, timeout, point_to_point=True,
                          on_stall=self.communicator.on_stall) if member else None

    # -- the one entry -----------------------------------------------------
    def run(self, request: Request) -> Any:
        """Run ``request`` (see Collective) as one checked call: the agreement,
        then the data; what the kind gives back (BROADCAST: root's payload;
        ALLGATHER with payloads: every rank's; a ``fresh`` ALLREDUCE: the new
        arrays; else None). A local error given as the request raises here,
        PeerError on the other ranks."""
        with self.calls():
            return self._run(request)

    def _run(self, request: Request) -> Any:
        """``run`` inside a call."""
        if isinstance(request, Collective) and request.kind == Kind.REDUCE_SCATTER:
            return self._reduce_scatter(request)
        if isinstance(request, Collective) and self.takes_engine(request):
            if self.engine is None:           # first use: the engine made once agreed on
                self._agree(request)
            results = self._engine().reduce_in_call(
                list(request.sends), not request.fresh, {"call": request.name, "op": request.op},
                mean=request.op == "mean")
            return results if request.fresh else None
        if isinstance(request, Collective) and request.fresh:
            copies = tuple(np.array(a, order="C") for a in request.sends)
            self._run(replace(request, sends=copies, fresh=False))
            return list(copies)
        extra = self._agree(request)
        assert isinstance(request, Collective)
        return self._move(request, extra)

    def _agree(self, request: Request) -> int:
        """The call's agreement: ``request``'s local checks and Description (a
        float sum's with MPIGRAD_REPRODUCIBLE, which picks its path); what
        root's BROADCAST adds to its message."""
        with checked(self.communicator) as call:
            if isinstance(request, Exception):
                raise request
            if _reduces(request.kind) and not request.recvs:
                check_no_aliasing(request.sends, range(len(request.sends)), f"{request.noun}s")
            spec = request
            if _reduces(request.kind) and any(_floating(a.dtype) for a in request.sends):
                spec = replace(request, settings=request.settings + (
                    ("MPIGRAD_REPRODUCIBLE", int(reproducible_setting(None))),))
            extra = len(request.payload or b"") if request.kind == Kind.BROADCAST else 0
            call.propose(spec.describe(), extra=extra)
        return call.extra

    def _reduce_scatter(self, spec: Collective) -> None:
        """The allreduce of a copy of ``spec``'s sends, back to back (the same
        agreement: its name and items), then this rank's part of it."""
        whole = np.concatenate([a.reshape(-1) for a in spec.sends])
        self._run(replace(spec, kind=Kind.ALLREDUCE, sends=(whole,), recvs=()))
        out = spec.recvs[0].reshape(-1)
        _write(out, whole[self.rank * out.size:(self.rank + 1) * out.size])

    def takes_engine(self, spec: Collective) -> bool:
        """Whether ``spec`` is a sum the engine makes (its agreement the call's):
        floating point, in place, of ``engine_bytes`` or more (or any size
        where sums are exact)."""
        return (spec.kind == Kind.ALLREDUCE and spec.op in ("sum", "mean") and not spec.recvs
                and bool(spec.sends) and all(_floating(a.dtype) for a in spec.sends)
                and (sum(a.nbytes for a in spec.sends) >= self.engine_bytes
                     or reproducible_setting(None)))

    def _engine(self) -> Engine:
        """The group's Engine, made on first use (collectively: every rank asks
        for the same sum) on the group's communicator, with the default
        settings (the mean is the call's)."""
        if self.engine is None:
            settings = Settings.validated(
                mean=True, degree=None, split_indices=None, bucket_bytes=None, skip=None,
                sparse="auto", check=True, timeout=self.communicator.timeout, verify=False,
                chunk_bytes=None, check_finite=False, shared_memory="auto",
                cross_memory="auto", on_failure=self.communicator.on_failure)
            self.engine = Engine(None, settings, communicator=self.communicator)
        return self.engine

    # -- the data ----------------------------------------------------------
    def _move(self, spec: Collective, extra: int) -> Any:
        comm, what = self.communicator, f"{spec.kind.value} of {spec.name}"
        if spec.kind in (Kind.ALLREDUCE, Kind.REDUCE):
            self._reduce(spec, what)
        elif spec.kind == Kind.BROADCAST:
            return self._broadcast(spec, extra, what)
        elif spec.kind in (Kind.ALLGATHER, Kind.GATHER):
            return self._gather(spec, what)
        elif spec.kind == Kind.SCATTER:
            mine = self.rank == spec.root
            send = np.concatenate([_bytes(a) for a in spec.sends]) if mine else None
            comm.scatter_bytes(send, _bytes(spec.recvs[0]), _root(spec), what)
        elif spec.kind == Kind.ALLTOALL:
            sends, recvs = [_bytes(a) for a in spec.sends], [_bytes(a) for a in spec.recvs]
            self._check_counts(spec.name, [a.size for a in sends], [a.size for a in recvs])
            recv = np.empty(sum(a.size for a in recvs), np.uint8)
            comm.wait(comm.start_alltoallv(
                np.concatenate(sends) if sends else np.empty(0, np.uint8),
                [a.size for a in sends], recv, [a.size for a in recvs], what))
            _unpack(recv, recvs)
        else:
            comm.collective("Barrier", (), what)
        return None

    def _check_counts(self, name: str, sends: Sequence[int], recvs: Sequence[int]) -> None:
        """Raise StructureMismatchError on every rank unless each rank receives
        from every rank as many bytes as that rank sends it (one Allgather of
        every rank's counts: each rank finds the same difference)."""
        counts = self.communicator.allgather_counts(
            [*sends, *recvs], f"Allgather of the message sizes of {name}")
        size = self.size
        for sender in range(size):
            for receiver in range(size):
                sent, expected = counts[sender, receiver], counts[receiver, size + sender]
                if sent != expected:
                    raise StructureMismatchError(
                        f"{name}: expecting each rank to receive what its peer sends it, got "
                        f"rank {sender} sending {sent} bytes to rank {receiver}, which expects "
                        f"{expected} bytes from it: make the splits (or the tensors' sizes) "
                        "agree across ranks")

    def _reduce(self, spec: Collective, what: str) -> None:
        """``spec``'s reduction, one MPI operation per wire dtype."""
        outputs = spec.outputs
        wires = [message_dtype(a.dtype, spec.op) for a in spec.sends]
        for wire in dict.fromkeys(wires):
            members = [i for i, w in enumerate(wires) if w == wire]
            alone = len(members) == 1 and spec.sends[members[0]].dtype == wire
            if alone and outputs[members[0]] is spec.sends[members[0]]:
                flat = spec.sends[members[0]].reshape(-1)      # in place, as it is
            else:
                flat = np.concatenate([spec.sends[i].reshape(-1).astype(wire) for i in members])
            op = "sum" if spec.op == "mean" else spec.op
            if spec.kind == Kind.ALLREDUCE:
                self.communicator.allreduce(flat, op, what)
            else:
                self.communicator.reduce(flat, op, _root(spec), what)
                if self.rank != spec.root:
                    continue
            if spec.op == "mean":
                if flat.dtype.kind in "iub":                 # integers averaged: float64
                    flat = flat.astype(np.float64)
                settle(flat, mean_factor(flat.dtype, self.size))
            offset = 0
            for i in members:
                out = outputs[i].reshape(-1)
                if out is not flat and not np.shares_memory(out, flat):
                    _write(out, flat[offset:offset + out.size])
                offset += out.size

    def _broadcast(self, spec: Collective, extra: int, what: str) -> Optional[bytes]:
        sizes = [a.nbytes for a in spec.sends]
        buf = np.empty(sum(sizes) + extra, np.uint8)
        mine = self.rank == spec.root
        if mine:
            offset = 0
            for array, n in zip(spec.sends, sizes):
                buf[offset:offset + n] = _bytes(array)
                offset += n
            buf[offset:] = np.frombuffer(spec.payload or b"", np.uint8)
        self.communicator.bcast_bytes(buf, _root(spec), what)
        if not mine:
            _unpack(buf, [_bytes(a) for a in spec.sends])
        return buf[sum(sizes):].tobytes() if spec.payload is not None or extra else None

    def _gather(self, spec: Collective, what: str) -> Optional[List[bytes]]:
        comm = self.communicator
        if spec.payload is not None:
            return [bytes(p) for p in comm.allgather_objects(spec.payload, what)]
        send = _bytes(spec.sends[0])
        everyone = spec.kind == Kind.ALLGATHER or self.rank == spec.root
        recvs = [_bytes(a) for a in spec.recvs] if everyone else []
        whole = len(recvs) == 1 and recvs[0].size == send.size * self.size
        recv = recvs[0] if whole else np.empty(send.size * self.size if everyone else 0,
                                               np.uint8)
        if spec.kind == Kind.ALLGATHER:
            comm.allgather_bytes(send, recv, what)
        else:
            comm.gather_bytes(send, recv if everyone else None, _root(spec), what)
        if everyone and not whole:
            _unpack(recv, recvs)
        return None

    # -- point-to-point ----------------------------------------------------
    def post(self, name: str, arrays: Sequence[np.ndarray], peer: Optional[int], tag: int,
             what: str) -> "Message":
        """Start sending ("Send") ``arrays`` to ``peer``, or receiving ("Recv")
        into them from it (None: from whichever rank sends first; one array),
        one message each, in order; the Message, to ``wait`` for or ``test``."""
        if self.p2p is None:
            raise RuntimeError("this group was made without point-to-point messages")
        if peer is None and len(arrays) != 1:
            raise ValueError(f"{what}: a receive from any rank takes one tensor, got "
                             f"{len(arrays)}")
        source = MPI.ANY_SOURCE if peer is None else peer
        buffers = [_bytes(a) for a in arrays]
        started = [self.communicator.start_message(name, b, source, tag, what, self.p2p)
                   for b in buffers]
        return Message(self.communicator, started, buffers, peer, what)

    def arrivals(self, seconds: Optional[float], tag: int) -> List[int]:
        """A barrier that can run out of time without harm, as gloo's monitored
        barrier: every rank messages rank 0, which answers each once all came.
        The ranks missing after ``seconds`` (on rank 0: those that did not
        come; elsewhere: [0] where rank 0 did not answer); [] once all came.
        No collective: the group stays usable either way."""
        token = np.zeros(1, np.uint8)
        deadline = None if seconds is None else time.monotonic() + seconds
        if self.rank == 0:
            waiting = {r: self.post("Recv", [np.zeros(1, np.uint8)], r, tag, f"arrival of rank {r}")
                       for r in range(1, self.size)}
        else:
            self.post("Send", [token], 0, tag, "arrival at rank 0").wait()
            waiting = {0: self.post("Recv", [token], 0, tag, "rank 0's answer")}
        while waiting and (deadline is None or time.monotonic() < deadline):
            waiting = {r: m for r, m in waiting.items() if not m.test()}
            time.sleep(0.0005)
        for message in waiting.values():
            message.cancel()
        if self.rank == 0 and not waiting:
            for r in range(1, self.size):
                self.post("Send", [token], r, tag, f"answer to rank {r}").wait()
        return sorted(waiting)

    def open_point_to_point(self) -> MPI.Intracomm:
        """The split that carries the group's point-to-point messages, made now
        if it is not yet (collective over the group; the watch serves every
        message on the group's own communicator)."""
        if self.p2p is None:
            self.p2p = self.communicator.split("point-to-point messages of the group")
        return self.p2p

    def free(self) -> None:
        """Free the group's engine and its communicator, where it made them."""
        if self.engine is not None and self.owns_engine:
            self.engine.free()
            self.engine = None
        if self.owned:
            self.communicator.free()


#: the Groups of mpigrad's functions, by their shared Communicator
_SHARED: "weakref.WeakKeyDictionary[Communicator, Group]" = weakref.WeakKeyDictionary()


def _floating(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name == "bfloat16"



def _write(out: np.ndarray, values: np.ndarray) -> None:
    """``values`` into the 1-D ``out`` in its dtype (bools from any nonzero)."""
    out[...] = values != 0 if out.dtype == np.bool_ else values.astype(out.dtype, copy=False)


def _root(spec: Collective) -> int:
    assert spec.root is not None
    return spec.root


def _bytes(array: np.ndarray) -> np.ndarray:
    """The C-contiguous ``array``'s bytes, as a flat uint8 view."""
    return array.reshape(-1).view(np.uint8)


def _unpack(received: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    """Consecutive pieces of the bytes ``received`` into the byte views ``arrays``."""
    offset = 0
    for array in arrays:
        array[...] = received[offset:offset + array.size]
        offset += array.size


class Message:
    """Point-to-point messages in flight (Group.post): ``wait`` for them
    (watched), or ``test`` them until done; ``peer`` then names the other
    rank (the sender, for a receive from any rank). A peer that has left
    raises PeerError; a message larger than its receiving array, ValueError."""

    def __init__(self, communicator: Communicator, started: Sequence[Any],
                 buffers: Sequence[np.ndarray], peer: Optional[int], what: str) -> None:
        self.communicator = communicator
        self.what = what
        self.started = list(started)
        self.sizes = [b.size for b in buffers]
        self.peer = peer
        self.status = MPI.Status()

    def test(self) -> bool:
        """Whether every message is done (progressing them)."""
        return self._complete(self.communicator.test)

    def wait(self) -> None:
        """Complete every message under the watch."""
        self._complete(self._waited)

    def _waited(self, started: Any, status: Any) -> bool:
        self.communicator.wait(started, status)
        return True

    def cancel(self) -> None:
        """Withdraw the messages not yet done (their group is going away)."""
        for started in self.started:
            started.request.Cancel()
            started.request.Wait()
        self.started.clear()

    def _complete(self, step: Callable[[Any, Any], bool]) -> bool:
        while self.started:
            try:
                if not step(self.started[0], self.status):
                    return False
            except MPI.Exception as exc:
                if exc.Get_error_class() != MPI.ERR_TRUNCATE:
                    raise
                self.started.clear()
                raise ValueError(f"{self.what}: the message is larger than the "
                                 f"{self.sizes[0]} bytes received into: expecting a receiving "
                                 "tensor of the sent one's size and dtype") from None
            if self.peer is None:
                self.peer = self.status.Get_source()
            self.started.pop(0)
            self.sizes.pop(0)
        return True

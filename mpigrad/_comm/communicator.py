"""The MPI side of every mpigrad call: a communicator of its own (a watched
duplicate of the caller's, watch.py), the collectives mpigrad issues on it,
each started through the watch's pre-start check (``start``) and waited on
under the watch (``wait``), and what a lost rank does to the call in progress
(``call``)."""

import hashlib
import pickle
import sys
from typing import (Any, Dict, List, NamedTuple, NoReturn, Optional, Sequence,
                    Union, cast)

import numpy as np
from mpi4py import MPI

from .._base.errors import (DivergenceError, MpigradError, PeerError, RanksLost,
                            StructureMismatchError)
from .._base.ranges import pieces
from .._base.settings import DEFAULT_CHUNK_BYTES
from .._base.description import FINGERPRINT_MASK
from .tally import TALLY
from .ulfm import agree, carry_on, is_process_failure, ulfm_problem
from .exchange import Exchange
from .launch_check import check_launch
from .watch import SURVIVORS_TOKEN, Channel, What

__all__ = ["Communicator", "Started", "What", "mpi_datatype", "install_abort_handler",
           "ulfm_problem"]

#: element counts per rank
Counts = Union[Sequence[int], np.ndarray]

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD, "band": MPI.BAND,
        "bor": MPI.BOR, "bxor": MPI.BXOR}
_MPI_TYPES: Dict[np.dtype, MPI.Datatype] = {}
_I64 = MPI.INT64_T


def mpi_datatype(dtype: Any) -> MPI.Datatype:
    """The predefined MPI datatype of a numpy dtype (cached)."""
    try:
        return _MPI_TYPES[dtype]
    except KeyError:
        return _MPI_TYPES.setdefault(dtype, MPI.Datatype.fromcode(np.dtype(dtype).char))


def _checksum(array: np.ndarray) -> int:
    digest = hashlib.blake2b(np.ascontiguousarray(array).view(np.uint8).data, digest_size=8)
    return int.from_bytes(digest.digest(), "little") & FINGERPRINT_MASK


class Started(NamedTuple):
    """A collective started non-blocking: its request, what it is called, a
    point-to-point message's peer, and the arguments it was started with: the
    buffers MPI reads and writes until it completes, alive as long as the
    Started is (mpi4py's request does not hold them: a packed copy dropped by
    its maker would be freed, and read or written after, while Open MPI moves
    it: a segmentation fault or garbage in the results)."""

    request: MPI.Request
    what: What
    peer: Optional[int] = None
    buffers: Any = None


_HELPERS: List[int] = []      # the MPI attribute key caching {parent type: helper Communicator}
#: a parent communicator's helpers, by its type (an attribute of the parent)
_Helpers = Dict[Any, "Communicator"]


def _free_helpers(parent: MPI.Comm, keyval: int, helpers: _Helpers) -> None:
    for helper in helpers.values():
        helper.free()


class Communicator:
    """One user's side of the MPI communication (a Reducer's, mpigrad's
    functions', a Horovod process set's): collectives on its own duplicate of
    the caller's communicator, watched (see watch.py).

    Args:
        comm: an mpi4py intracommunicator; default ``MPI.COMM_WORLD``.
        chunk_bytes: the largest message of one Allreduce call.
        timeout: seconds a collective may take before the job is aborted with
            a diagnostic; None waits forever (a peer that leaves still raises).
        on_failure: what a lost rank (MPI's fault tolerance reports it) does to
            the call in progress: "abort", PeerError on every survivor and the
            communicator unusable; "shrink", RanksLost after the communicator
            has moved to the survivors.
        on_stall: what a call past ``timeout`` does: "abort" the job with a
            diagnostic; "raise" TimedOut with it, this communicator unusable
            from then on (the torch backend's groups, as gloo's).
    """

    def __init__(self, comm: Optional[MPI.Intracomm] = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout: Optional[float] = None,
                 on_failure: str = "abort", on_stall: str = "abort") -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm: expecting an mpi4py Intracomm, got {type(comm).__name__}")
        self.size: int = comm.Get_size()
        self.rank: int = comm.Get_rank()
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self.on_failure = on_failure
        check_launch()
        self.channel = Channel(comm, timeout)
        self.channel.on_stall = on_stall     # past the timeout: MPI_Abort, or raise TimedOut
        self.comm: MPI.Comm = self.channel.comm
        self.calls = 0
        self.freed = False
        # the error the last agreement raised (every rank raised it or a
        # PeerError for it at the same point of the call)
        self.agreed: Optional[BaseException] = None
        # what the calls in progress started (their buffers), until a call ends well,
        # cleared of completed operations when it reaches ``prune_at`` entries (the
        # engine starts many a call: a completed one's packed copy is not held)
        self.in_flight: List[Started] = []
        self.prune_at = _IN_FLIGHT_PRUNED_AT

    @classmethod
    def helper(cls, comm: Optional[MPI.Intracomm] = None,
               timeout: Optional[float] = None) -> "Communicator":
        """The Communicator that mpigrad's functions (broadcast, ...) share on
        ``comm``: made on the first call (collectively), kept with the duplicate."""
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm: expecting an mpi4py Intracomm, got {type(comm).__name__}")
        if not _HELPERS:
            _HELPERS.append(MPI.Comm.Create_keyval(delete_fn=_free_helpers))
        # cached on the parent, freed with it
        helpers = cast("Optional[_Helpers]", comm.Get_attr(_HELPERS[0]))
        if helpers is None:
            helpers = {}
            comm.Set_attr(_HELPERS[0], helpers)
        helper: Optional[Communicator] = helpers.get(type(comm))
        if helper is None:
            helper = helpers[type(comm)] = cls(comm, DEFAULT_CHUNK_BYTES, timeout)
        helper.timeout = timeout
        return helper

    # -- calls -------------------------------------------------------------
    def call(self, begin: bool = True, completes: bool = True) -> "CallScope":
        """One call of a Reducer or function, as a ``with`` block: one thread
        at a time, numbered (``begin``), ended when the block ends
        (``completes``; by an exception, always). Raises RuntimeError once
        freed, a call begun before ``free()`` included. A lost rank inside it
        becomes PeerError or RanksLost (``on_failure``). An exception the
        peers do not share (not agreed: KeyboardInterrupt or SystemExit in a
        wait, an error after the agreement, an MPI error that is not a lost
        rank) abandons the call: see ``abandon``."""
        return CallScope(self, begin, completes)

    @property
    def exchange(self) -> Exchange:
        """The agreements' buffers and their exchange (exchange.py): the
        duplicate's (a shrink moves to the survivors')."""
        return self.channel.exchange

    def shared(self, error: BaseException) -> bool:
        """Whether every rank raised ``error`` (or its PeerError) at the same
        point of the call: the last agreement's error, a lost or departed
        peer, a difference found beside the data or after it."""
        cause: Optional[BaseException] = error      # or what a face raised it as
        while cause is not None:
            if cause is self.agreed or isinstance(
                    cause, (PeerError, StructureMismatchError, DivergenceError, RanksLost)):
                return True
            cause = cause.__cause__
        return False

    def raise_agreed(self, error: BaseException) -> NoReturn:
        """Raise ``error``, which every rank of the call raises at this point."""
        self.agreed = error
        raise error

    def abandon(self, error: BaseException) -> None:
        """This rank leaves the current call mid-way for ``error``, which its
        peers do not share: they are told at once (their waits in this call
        raise PeerError naming it, instead of stalling until the watchdog),
        and every later call here raises."""
        call = self.calls
        why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        self.channel.tainted = True      # what it started, or its peers will, stays incomplete
        self.channel.goodbye(f"abandoned call {call} ({why})", self.channel.finished)
        self.channel.broken = RuntimeError(
            f"this rank abandoned call {call} ({why}) without its peers, which cannot "
            "complete it; this communicator (its Reducer, its functions) is unusable: "
            "create a new Reducer")

    def end_call(self, failed: bool = False) -> None:
        """The current call ended (``failed``: by an exception). A goodbye
        says how far this rank got, so that peers still in a call know
        whether its collectives can complete (see Channel.goodbye)."""
        self.channel.settled = self.calls
        if not failed:
            self.channel.finished = self.calls

    def after_loss(self) -> MpigradError:
        """The error to raise on a lost rank; first, move to the survivors'
        communicator (every survivor comes here: the first to see the loss
        revokes the communicator)."""
        before = self.size
        lost = self.shrink()
        if self.on_failure == "shrink":
            return RanksLost(lost, self.size)
        error = PeerError(lost, ["its process failed"] * len(lost),
                          f"the Reducer lost ranks of its {before}")
        self.channel.broken = error            # every later collective raises it
        return error

    def shrink(self) -> List[int]:
        """Carry on over the survivors of a lost rank (collective over them:
        ULFM's revoke and shrink); returns the lost ranks."""
        lost: List[int] = carry_on(self.comm, self.rejoin, self.timeout)
        return lost

    def rejoin(self, comm: MPI.Intracomm) -> None:
        """Carry on over ``comm`` (the survivors of a shrink, new and private
        to this Communicator), watched, in place of the revoked duplicate."""
        self.channel.abandon()
        # MPI's fault-tolerant agreement: every survivor returns, or all of
        # them raise if another rank was lost meanwhile
        agree(comm, self.timeout)
        on_stall = self.channel.on_stall
        self.channel = Channel(comm, self.timeout, duplicate=False, token=SURVIVORS_TOKEN)
        self.channel.on_stall = on_stall
        self.comm = self.channel.comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.calls = 0

    # -- starting and waiting ------------------------------------------------
    def start(self, name: str, args: Sequence[Any], what: What,
              comm: Optional[MPI.Comm] = None, moves: float = 0) -> Started:
        """Start collective ``name`` (e.g. "Allreduce") as its non-blocking
        twin, after the watch's pre-start check (a peer that left will not
        take part: PeerError now). ``comm``: a communicator split from the
        duplicate (default: the duplicate itself); ``moves``: the bytes this
        rank sends, by the operation's definition (``mpigrad.statistics``).
        Every collective mpigrad starts, in every face, starts here."""
        self.channel.check(self.calls, self.timeout)
        comm = self.comm if comm is None else comm
        key = (type(comm), name)
        method = _STARTS.get(key)
        if method is None:             # (a subclass of a caller's may override it)
            method = _STARTS[key] = getattr(type(comm), "I" + name.lower())
        TALLY.operations += 1
        TALLY.moved += int(moves)
        return self._flying(Started(method(comm, *args), what, None, args))

    def start_agreement(self, what: What) -> Started:
        """Start the agreement's exchange (exchange.py), after the watch's
        pre-start check: the duplicate's persistent Allgather, or a new
        Iallgather of its buffers where the library has none."""
        self.channel.check(self.calls, self.timeout)
        exchange = self.channel.exchange
        request: MPI.Request
        if exchange.request is None:
            request = self.comm.Iallgather(*exchange.buffers)
        else:
            request = exchange.request
            request.Start()
        TALLY.operations += 1
        TALLY.moved += exchange.moves
        return self._flying(Started(request, what, None, exchange.buffers))

    def _flying(self, started: Started) -> Started:
        """``started``, in flight until its call ends."""
        flight = self.in_flight
        if len(flight) >= self.prune_at:             # a request done is null (falsy)
            flight[:] = [s for s in flight if s.request]
            self.prune_at = 2 * len(flight) + _IN_FLIGHT_PRUNED_AT
        flight.append(started)
        return started

    def end_flight(self, failed: bool) -> None:
        """A call ended: what it started leaves the in-flight list (ended well, it
        has completed; a started call's operations, waited in a later call, are held
        by its Pending). ``failed``: it ended by an exception, and what it started and
        never completed stays as it is for good, its buffers with it (MPI may still
        write into them: a peer's data arriving for a call this rank left, on a
        communicator that is never freed)."""
        if failed:
            _LEFT_IN_FLIGHT.extend(s for s in self.in_flight if s.request)
        self.in_flight.clear()
        self.prune_at = _IN_FLIGHT_PRUNED_AT

    def wait(self, started: Started, status: Optional[MPI.Status] = None) -> None:
        """Complete a started collective under the watch (PeerError if a peer
        leaves, abort with a diagnostic past the timeout); ``status``: filled in."""
        self.channel.wait(started.request, started.what, self.calls, self.timeout,
                          started.peer, status)

    def test(self, started: Started, status: Optional[MPI.Status] = None) -> bool:
        """Whether a started point-to-point message is done (``status`` filled
        in), progressing it: PeerError where its peer has left."""
        return self.channel.test(started.request, started.what, started.peer, status)

    @property
    def on_stall(self) -> str:
        """What a call past the timeout does ("abort" or "raise")."""
        return self.channel.on_stall

    def collective(self, name: str, args: Sequence[Any], what: What,
                   comm: Optional[MPI.Comm] = None) -> None:
        """Run collective ``name`` to completion: started and waited on as
        above (as fast as the blocking call, and it cannot hang)."""
        self.wait(self.start(name, args, what, comm))

    def split(self, what: str, color: int = 0, key: int = 0, shared: bool = False,
              parent: Optional[MPI.Intracomm] = None,
              within: Optional[MPI.Intracomm] = None) -> MPI.Intracomm:
        """MPI's Comm_split of ``parent`` (default: the duplicate, or ``within``,
        a part of it; ``color`` MPI.UNDEFINED: not in any part), or with
        ``shared`` its Comm_split_type into the ranks that share memory.
        Blocking and unwatched in MPI, so a watched barrier goes first: a rank
        that never comes is named by the watch instead of hanging the others.
        A part of the duplicate (or of ``within``) is freed with it."""
        self.collective("Barrier", (), f"barrier before {what} (every rank must take part)")
        base = parent or within or self.comm
        TALLY.operations += 1
        part = base.Split_type(MPI.COMM_TYPE_SHARED, key=key) if shared else base.Split(color, key)
        if parent is None and part != MPI.COMM_NULL:
            self.channel.adopt(part)
        return cast(MPI.Intracomm, part)

    def create_group(self, ranks: Sequence[int]) -> MPI.Intracomm:
        """MPI's Comm_create_group of ``ranks`` of the duplicate: collective
        over those ranks only (the others need not call). Blocking and
        unwatched in MPI: a member that never comes stalls the others."""
        group = self.comm.Get_group().Incl(list(ranks))
        TALLY.operations += 1
        try:
            part = cast(MPI.Intracomm, self.comm).Create_group(group)
        finally:
            group.Free()
        self.channel.adopt(part)
        return part

    # -- collectives -----------------------------------------------------
    def start_allreduce(self, buf: np.ndarray, op: str, what: What,
                        comm: Optional[MPI.Comm] = None) -> Started:
        """Start reducing the contiguous array ``buf`` with ``op`` ("sum",
        "max", "min", "prod", "band", "bor", "bxor"), in place."""
        return self.start("Allreduce", (MPI.IN_PLACE, [buf, mpi_datatype(buf.dtype)], _OPS[op]),
                          what, comm, 2 * self.shared_part(buf.nbytes, comm))

    def allreduce(self, buf: np.ndarray, op: str, what: What = "Allreduce",
                  comm: Optional[MPI.Comm] = None) -> None:
        """Reduce the contiguous array ``buf`` with ``op``, in place (watched)."""
        if buf.size:
            self.wait(self.start_allreduce(buf, op, what, comm))

    def allreduce_sum(self, buf: np.ndarray, what: What = "Allreduce",
                      comm: Optional[MPI.Comm] = None) -> None:
        """Sum the 1-D contiguous array ``buf`` over all ranks (of ``comm``),
        in place, in pieces of at most ``chunk_bytes``."""
        self.allreduce_pieces(buf, "sum", what, comm)

    def allreduce_pieces(self, buf: np.ndarray, op: str, what: What = "Allreduce",
                         comm: Optional[MPI.Comm] = None) -> None:
        """Reduce the 1-D contiguous array ``buf`` with ``op`` over all ranks
        (of ``comm``), in place, in pieces of at most ``chunk_bytes``."""
        for lo, hi in pieces(buf.size, buf.itemsize, self.chunk_bytes):
            self.allreduce(buf[lo:hi], op, what, comm)

    def start_reduce(self, buf: np.ndarray, op: str, root: int, what: What) -> Started:
        """Start reducing the contiguous array ``buf`` with ``op`` into
        ``root``'s, in place there (the others' stay as they are)."""
        args = [buf, mpi_datatype(buf.dtype)]
        mine = self.rank == root
        return self.start("Reduce", (MPI.IN_PLACE if mine else args, args if mine else None,
                                     _OPS[op], root), what, moves=self.shared_part(buf.nbytes))

    def start_sum(self, piece: np.ndarray, what: What, comm: Optional[MPI.Comm] = None
                  ) -> Started:
        """Start summing one piece of a reduction's data (contiguous) in place."""
        return self.start_allreduce(piece, "sum", what, comm)

    def start_reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: Counts,
                             what: What, op: str = "sum") -> Started:
        """Start reducing the 1-D ``send`` with ``op`` over all ranks; this rank
        receives its ``counts[rank]`` elements of the result in ``recv`` (rank
        order: rank r gets the r-th range of ``counts``)."""
        datatype = mpi_datatype(send.dtype)
        return self.start("Reduce_scatter", ([send, datatype], [recv, datatype],
                                             [int(c) for c in counts], _OPS[op]), what,
                          moves=send.nbytes - recv.nbytes)

    def start_bcast(self, buf: np.ndarray, root: int, what: What) -> Started:
        """Start broadcasting the contiguous array ``buf`` from ``root``, in place."""
        buf = _movable(buf)
        return self.start("Bcast", ([buf, mpi_datatype(buf.dtype)], root), what,
                          moves=self.shared_part(buf.nbytes))

    def start_alltoallv(self, send: np.ndarray, send_counts: Counts, recv: np.ndarray,
                        recv_counts: Counts, what: What,
                        comm: Optional[MPI.Comm] = None) -> Started:
        """Start sending ``send_counts[r]`` elements of the 1-D ``send`` (in
        order) to rank r, receiving ``recv_counts[r]`` from each into ``recv``
        (over ``comm``, a split of the duplicate; default: the duplicate)."""
        send, recv = _movable(send), _movable(recv)
        datatype = mpi_datatype(send.dtype)
        send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        return self.start("Alltoallv", (
            [send, (send_counts, self.displacements(send_counts)), datatype],
            [recv, (recv_counts, self.displacements(recv_counts)), datatype]), what, comm,
            (sum(send_counts) - send_counts[(comm or self.comm).Get_rank()]) * send.itemsize)

    def alltoall_counts(self, counts: Counts, what: What) -> List[int]:
        """Send ``counts[r]`` to rank r; every rank's count for this one, in rank order."""
        sent = np.array(counts, np.int64)
        got = np.empty(self.size, np.int64)
        self.collective("Alltoall", ([sent, _I64], [got, _I64]), what)
        return [int(g) for g in got]

    def allgather_counts(self, local: Any, what: What = "Allgather of sparse row counts"
                         ) -> np.ndarray:
        """Every rank's int64 vector ``local``, as a (ranks, len(local)) matrix."""
        local = np.ascontiguousarray(local, dtype=np.int64)
        out = np.empty((self.size, local.size), np.int64)
        self.collective("Allgather", ([local, _I64], [out, _I64]), what)
        return out

    def shared_part(self, nbytes: int, comm: Optional[MPI.Comm] = None) -> float:
        """(p-1)/p of ``nbytes`` over ``comm``'s p ranks (default: the
        duplicate's): what a rank sends of a buffer that every rank's data
        makes up (a reduce-scatter's, an allgather's, a broadcast's)."""
        ranks = self.size if comm is None else comm.Get_size()
        return nbytes * (ranks - 1) / ranks

    def displacements(self, counts: Counts) -> List[int]:
        """Where each rank's part starts when parts of ``counts`` lie back to back."""
        offsets: List[int] = np.cumsum([0] + [int(c) for c in counts[:-1]]).tolist()
        return offsets

    def start_allgatherv(self, send: np.ndarray, counts: Counts, recv: np.ndarray,
                         what: What, comm: Optional[MPI.Comm] = None) -> Started:
        """Start concatenating every rank's 1-D ``send`` in rank order into
        ``recv`` (``counts[r]``: rank r's elements; bytes for 2-byte floats
        and bools travel as their bits; over ``comm``, as start_alltoallv)."""
        send, recv = _movable(send), _movable(recv)
        datatype = mpi_datatype(send.dtype)
        counts = [int(c) for c in counts]
        return self.start("Allgatherv", ([send, datatype],
                                         [recv, (counts, self.displacements(counts)), datatype]),
                          what, comm, self.shared_part(recv.nbytes, comm))

    def allgatherv(self, send: np.ndarray, counts: Counts, what: What = "Allgatherv",
                   out: Optional[np.ndarray] = None) -> np.ndarray:
        """Concatenate every rank's 1-D ``send`` in rank order (into ``out``,
        1-D of their total size, else a new array); ``counts[r]`` is rank r's
        element count."""
        recv = np.empty(sum(int(c) for c in counts), send.dtype) if out is None else out
        if recv.size:
            self.wait(self.start_allgatherv(send, counts, recv, what))
        return recv

    def allgather_reports(self, report: Optional[str]) -> List[Optional[str]]:
        """Every rank's error report (None: none), in rank order; the watch's
        label carries this rank's, so that a stall here says what it reported."""
        mine = "none" if report is None else report if len(report) <= 200 else \
            report[:197] + "..."
        return self.allgather_objects(report, f"error reports (this rank's: {mine})")

    def allgather_objects(self, obj: Any, what: str = "error reports") -> List[Any]:
        """Every rank's picklable ``obj``, in rank order (watched)."""
        mine = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = self.allgather_counts([mine.size], f"Allgather of the sizes of {what}")[:, 0]
        data = self.allgatherv(mine, sizes, f"Allgatherv of {what}")
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        return [pickle.loads(data[a:b].tobytes()) for a, b in zip(bounds[:-1], bounds[1:])]

    def start_allgather_bytes(self, send: Optional[np.ndarray], recv: np.ndarray,
                              what: What) -> Started:
        """Start gathering every rank's uint8 ``send`` (the same size on each)
        into ``recv`` in rank order; ``send`` None: this rank's part is in
        ``recv`` already (MPI's in place)."""
        return self.start("Allgather", (MPI.IN_PLACE if send is None else [send, MPI.BYTE],
                                        [recv, MPI.BYTE]), what,
                          moves=self.shared_part(recv.nbytes))

    def start_gather_bytes(self, send: np.ndarray, recv: Optional[np.ndarray], root: int,
                           what: What) -> Started:
        """Start gathering every rank's uint8 ``send`` (the same size on each)
        into ``root``'s ``recv`` in rank order (None elsewhere)."""
        return self.start("Gather", ([send, MPI.BYTE],
                                     None if recv is None else [recv, MPI.BYTE], root), what,
                          moves=0 if self.rank == root else send.nbytes)

    def start_scatter_bytes(self, send: Optional[np.ndarray], recv: np.ndarray, root: int,
                            what: What) -> Started:
        """Start cutting ``root``'s uint8 ``send`` (None elsewhere) into equal
        parts, the r-th into rank r's ``recv``."""
        return self.start("Scatter", (None if send is None else [send, MPI.BYTE],
                                      [recv, MPI.BYTE], root), what,
                          moves=0 if send is None else self.shared_part(send.nbytes))

    def start_message(self, name: str, buf: np.ndarray, peer: int, tag: int, what: What,
                      comm: MPI.Comm) -> Started:
        """Start point-to-point ``name`` ("Send" or "Recv") of the uint8 ``buf``
        with ``peer`` over ``comm`` (a split of the duplicate)."""
        started = self.start(name, ([buf, MPI.BYTE], peer, tag), what, comm,
                             buf.nbytes if name == "Send" else 0)
        return Started(started.request, started.what,
                       None if peer == MPI.ANY_SOURCE else peer, started.buffers)

    def verify_same(self, arrays: Sequence[np.ndarray], what: str) -> None:
        """Raise DivergenceError on every rank unless ``arrays`` are bitwise equal
        on all ranks (one Allreduce of checksums)."""
        sums = np.array([_checksum(a) for a in arrays], np.int64)
        flags = np.concatenate([sums, -sums])
        self.allreduce(flags, "max", f"verify of {what}")
        bad = np.nonzero(flags[:sums.size] != -flags[sums.size:])[0]
        if bad.size:
            raise DivergenceError(f"{what}: results differ across ranks at "
                                  f"{[int(b) for b in bad]}; the MPI library's reduction "
                                  "is not deterministic across ranks")

    def free(self) -> None:
        """Free the duplicate; the peers are told (idempotent: a second call
        touches nothing, not even a module global gone at interpreter exit)."""
        if self.freed:
            return
        self.channel.free()
        self.freed = True
        self.comm = MPI.COMM_NULL


class CallScope:
    """A call's ``with`` block (``Communicator.call``): a class, not a
    generator, because small calls pay for every microsecond of it."""

    __slots__ = ("communicator", "begin", "completes", "channel")

    def __init__(self, communicator: Communicator, begin: bool, completes: bool) -> None:
        self.communicator = communicator
        self.begin = begin
        self.completes = completes
        self.channel: Optional[Channel] = None

    def __enter__(self) -> None:
        comm = self.communicator
        if comm.freed:
            raise RuntimeError("this Reducer was freed; create a new one")
        channel = self.channel = comm.channel     # (a shrink replaces it inside the call)
        channel.enter()
        if self.begin:
            comm.calls += 1
            TALLY.calls += 1

    def __exit__(self, kind: Optional[type], error: Optional[BaseException],
                 trace: Any) -> None:
        comm = self.communicator
        assert self.channel is not None
        # a lost rank: every peer meets it; any other error of the MPI library (a
        # message truncated or misdelivered) is this rank's alone, as a local error is
        lost = isinstance(error, MPI.Exception) and is_process_failure(error, comm.comm)
        try:
            if error is None:
                if self.completes:
                    comm.end_call()
                    comm.end_flight(failed=False)
            elif lost or comm.shared(error):
                comm.end_call(failed=True)
            else:
                comm.abandon(error)
        finally:
            if error is not None:
                comm.end_flight(failed=True)
            self.channel.leave()
        if lost:
            raise comm.after_loss() from None


#: the non-blocking twin of each collective mpigrad starts, by communicator type and name
_STARTS: Dict[Any, Any] = {}
#: operations of calls ended by an exception, never completed: kept with their buffers
_LEFT_IN_FLIGHT: List[Started] = []
#: a call's in-flight list is first cleared of completed operations at this length
#: (then at twice what is left, plus this)
_IN_FLIGHT_PRUNED_AT = 16


def _movable(array: np.ndarray) -> np.ndarray:
    """``array`` as MPI can move it: 2-byte floats (float16, bfloat16) and
    bools as their bits."""
    if array.dtype.kind == "f" and array.dtype.itemsize == 2 or array.dtype.name == "bfloat16":
        return array.view(np.uint16)
    if array.dtype == np.bool_:
        return array.view(np.uint8)
    return array


def install_abort_handler() -> None:
    """Make an uncaught exception on this rank abort the whole MPI job.

    For programs that cannot be launched as ``python -m mpi4py script.py``:
    without it, the other ranks would wait forever in their next collective.
    """
    previous = sys.excepthook

    def abort_on_uncaught(kind: Any, value: Any, tb: Any) -> None:
        previous(kind, value, tb)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_on_uncaught

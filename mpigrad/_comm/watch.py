"""Watching mpigrad's collectives so that no rank hangs silently.

Each Reducer owns a duplicate of its parent communicator (a Channel): its
collectives can never match another Reducer's, even when a rank abandons one.
A Reducer that is never freed is freed when it is garbage collected (MPICH and
Open MPI release a communicator locally), and if the MPI library still runs
out of communicators, a collection is forced and the duplication retried.

Every collective is started non-blocking and waited for in a loop that yields
the core (ranks sharing cores do not slow each other; as fast as the blocking
call here) and that also serves small point-to-point notices between ranks:

- goodbye: a rank that frees a Reducer, or abandons a call, tells its peers;
  one whose program ends while it holds a live Reducer (normally, by an
  uncaught exception or sys.exit) tells them along a tree, in O(log p)
  notices per rank (departures.py); a peer waiting in, or entering, a
  collective of that Reducer raises PeerError naming the rank and what
  happened, instead of waiting forever;
- ended: a rank whose program ends tells, directly, the peers that may still
  send to it where the tree does not reach them: those that have not said
  goodbye to a duplicate it left (freed, or left with an abandoned call), those
  that left one it holds, and those not heard of by the end of its exit (their
  programs go on). Their later goodbyes and exits skip it (a send to a process
  whose MPI has finalized can block for ever: libfabric's tcp retries its
  connect);
- query / status: a rank whose collective passes the watchdog's timeout asks
  every peer where it is, and names in its diagnostic the ranks that did not
  arrive and every rank's call number, before it aborts the job.

Notices carry a token agreed when the Channel is made, so a stale notice that
outlives a freed duplicate is never taken for one of a later Channel.
"""

import atexit
import gc
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, NoReturn, Optional, Set, Tuple, Union

import numpy as np
from mpi4py import MPI

from .._base.errors import PeerError, TimedOut
from .deadman import FINALIZE_GRACE, GRACE, Deadline, end_within, ended_after
from .departures import Departure, Spread, pack, subtree, unpack
from .exchange import Exchange
from .tally import TALLY
from .ulfm import is_process_failure, ulfm_problem

__all__ = ["Channel", "SURVIVORS_TOKEN", "What"]

#: what a collective is called in a stall diagnostic: a string, or a callable
#: that makes one (evaluated only on a stall)
What = Union[str, Callable[[], str]]

# message tags on a Channel
_GOODBYE, _QUERY, _STATUS, _DEPARTURES, _ENDED = 0x6D67, 0x6D68, 0x6D69, 0x6D6A, 0x6D6B
_MAX_NOTICE = 900             # bytes: notices stay small (sent eagerly)
_RETIRED_WAIT_SECONDS = 5.0
_ANSWER_SECONDS = 2.0         # how long a stalled rank waits for its peers' answers
_LAST_MESSAGE_SECONDS = 2.0   # how long a message from a peer that left may still take
#: the token of a survivors' communicator after a shrink: it is new and
#: private, so any value every survivor uses will do (an agreed random one
#: would need a collective more); random tokens are drawn below 2**62 and
#: almost never equal it
SURVIVORS_TOKEN = (1 << 40) | 1

_live: "weakref.WeakSet[Channel]" = weakref.WeakSet()   # Channels to say goodbye on at exit
_retired: "List[Channel]" = []      # freed Channels waiting for their peers' goodbyes
#: the communicators of tainted Channels, never freed (Channel.release_if_done)
_KEPT: "List[Tuple[MPI.Comm, ...]]" = []
_outbox: List[MPI.Request] = []     # notices sent and not yet completed (they hold their data)
_stranded: List[MPI.Request] = []   # stalled calls' requests (on_stall="raise"): their buffers kept
#: at exit, how long the goodbyes may take to go out while the peers' come in
_EXIT_SECONDS = 5.0
#: at exit, after how long without a peer's notice a rank moves on to its next
#: phase without the notices it waits for (departures.py)
_QUIET_SECONDS = 0.2
_uncaught: List[str] = []           # the exception that is ending the program, if any
_hooked = False


def _record_uncaught(previous: Callable[..., Any]) -> Callable[..., None]:
    def hook(kind: Any, value: Any, tb: Any) -> None:
        _uncaught[:] = [f"by an uncaught {kind.__name__}: {value}"]
        previous(kind, value, tb)
    return hook


def _say_goodbye_at_exit() -> None:
    # bounded: a goodbye to a peer whose program has ended, and whose own
    # goodbye got lost, can block in the transport (a failed exit, not a hang)
    with ended_after(int(_EXIT_SECONDS) + FINALIZE_GRACE):
        _say_goodbyes()


def _say_goodbyes() -> None:
    how = _uncaught[0] if _uncaught else "(returned or sys.exit)"
    channels = list(_live)
    _take_notices(channels)              # peers already ending are not told
    for channel in channels:
        # dying of an exception raised inside a call: that call may not have
        # done its collectives; a call that raised an agreed error did
        channel.exit_start(f"its program ended {how}",
                           channel.finished if _uncaught else channel.settled)
    reason = f"its program ended {how}"
    for channel in channels + _retired:
        channel.tell_ended(reason)
    # every channel's two phases (departures.py) at once, taking the peers'
    # notices in while ours go out (with many Reducers the transports' queues
    # would fill up both ways, each rank blocked in a send the other never
    # takes in); freed duplicates wait for their peers' goodbyes too (a message
    # left unreceived at MPI_Finalize is a warning of the transport's), and a
    # peer told that this program ends for its final notice (it checks for
    # ours just before it sends, and ours may come just after): or a quiet
    # moment; a few seconds at most
    deadline = time.monotonic() + _EXIT_SECONDS
    quiet_since = time.monotonic()
    while time.monotonic() < deadline and not MPI.Is_finalized():
        if _take_notices(channels):
            quiet_since = time.monotonic()
            for channel in channels + _retired:     # peers that left meanwhile
                channel.tell_ended(reason)
        for channel in channels:
            channel.exit_step(_QUIET_SECONDS)
        if _sent() and all(channel.exit_done for channel in channels) and (
                all(channel.heard_from_everyone() for channel in _retired)
                and not any(channel.awaiting for channel in channels + _retired)
                or time.monotonic() - quiet_since > _QUIET_SECONDS):
            return
        os.sched_yield()


def _take_notices(channels: List["Channel"]) -> bool:
    """Take in the notices that have come for ``channels`` and the retired
    ones; whether any had."""
    return any([channel.take_notices() for channel in channels + _retired])


def _sent() -> bool:
    """Whether every notice sent has gone out (those that have are dropped)."""
    _outbox[:] = [request for request in _outbox if not _gone_out(request)]
    return not _outbox


def _gone_out(request: MPI.Request) -> bool:
    """Whether a notice has gone out, or never will (its peer was lost)."""
    try:
        return bool(request.Test())
    except MPI.Exception:
        return True


def _install_hooks() -> None:
    global _hooked
    if not _hooked:
        _hooked = True
        sys.excepthook = _record_uncaught(sys.excepthook)
        atexit.register(_say_goodbye_at_exit)   # runs before mpi4py's MPI_Finalize


def _free_retired(limit: Optional[int] = None) -> None:
    """Free the retired duplicates whose peers have all said goodbye; with a
    ``limit``, wait (a few seconds at most) until no more than that many are
    left: their peers' goodbyes are on their way."""
    deadline = time.monotonic() + _RETIRED_WAIT_SECONDS
    while True:
        _retired[:] = [channel for channel in _retired if not channel.release_if_done()]
        if limit is None or len(_retired) <= limit or time.monotonic() > deadline:
            return
        time.sleep(0.001)


def _text(what: Optional[What]) -> Optional[str]:
    return what() if callable(what) else what


def _discard_unreceived(comm: MPI.Comm) -> None:
    """Receive and drop the messages sent on ``comm`` that nobody received (a
    point-to-point message of a failed call): freed with them, its context
    could be reused by a later communicator whose receives they would match."""
    if comm == MPI.COMM_NULL:
        return
    status = MPI.Status()
    while True:
        message = comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
        if message is None:
            return
        message.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE])


def _persistent_allgather(comm: MPI.Comm, buffers: Any) -> Optional[MPI.Prequest]:
    """The Allgather of ``buffers`` on ``comm`` made persistent (collective), or None
    where the MPI library has no persistent collectives (before MPI 4)."""
    try:
        request: MPI.Prequest = comm.Allgather_init(*buffers)
        return request
    except (NotImplementedError, MPI.Exception):
        return None


class Channel:
    """A duplicate of ``parent`` with its watch (collective: every rank of
    ``parent`` makes one, in the same order). ``duplicate=False`` takes
    ``parent`` itself, for a communicator nobody else has (the survivors'
    after a shrink: duplicating it could wait forever on a rank lost
    meanwhile), with ``token`` agreed by the caller."""

    def __init__(self, parent: MPI.Comm, timeout: Optional[float], duplicate: bool = True,
                 token: Optional[int] = None) -> None:
        self.rank, self.size = parent.Get_rank(), parent.Get_size()
        self.comm = parent                   # until the duplicate exists
        self.gone: Dict[int, Tuple[str, int, bool]] = {}   # rank -> (why it left, calls it
                                             # completed,
                                             #          whether its program is ending)
        self.finished = 0                    # calls this rank completed on it
        self.settled = 0                     # calls that ended here, by an exception too
        # once a collective was abandoned (here or by a peer): raised by every
        # later start
        self.broken: Optional[Exception] = None
        self.left = False                    # this rank said goodbye
        self.ended: Set[int] = set()         # peers whose program ended, told directly
        # peers whose final notice (or ended notice) is still to come: told at exit
        # that this program ends, or ending when this rank left without telling them
        self.awaiting: Set[int] = set()
        self.told_ended: Set[int] = set()    # at exit: peers told so directly
        self.held_at_exit = False            # its program ended with it held (not left)
        # a collective started here was left incomplete (here or by a peer,
        # as its goodbye says): its messages may wait in some rank's queue
        # for ever, so the duplicate is never freed (see ``release_if_done``)
        self.tainted = False
        self.on_stall = "abort"              # or "raise": TimedOut, the channel broken
        self.spread = Spread(self.rank, self.size)   # what the tree neighbours know
        self.exit_phase = ""                 # at exit: "up", "down", then "done"
        self.own: Optional[Departure] = None  # this rank's departure, once its program ends
        self.last_notice = 0.0               # when a notice last came (monotonic)
        self.current: Optional[Tuple[int, What]] = None   # (call, what) while waiting
        self._answers: Dict[int, Tuple[Any, ...]] = {}    # rank -> its status, while asking
        self.busy = threading.Lock()         # held by the thread inside a call on it
        self.adopted: List[MPI.Comm] = []    # communicators split from the duplicate
        _free_retired()                      # before adding a communicator
        # with MPI's fault tolerance on, a wait also ends when the
        # communicator is revoked: a non-blocking collective waiting on a
        # survivor that left it for the recovery would not always end
        self.revocable = ulfm_problem() is None
        # there (and only there: it costs) a wait stuck inside the library
        # ends the process from below (deadman.py)
        self.deadline = Deadline() if self.revocable else None
        self.inside = False                  # a thread is inside a call
        dup = self._duplicate(parent, timeout) if duplicate else parent
        dup.Set_errhandler(MPI.ERRORS_RETURN)
        self.comm = dup
        if token is None:
            drawn = np.random.default_rng().integers(1, 1 << 62, size=1, dtype=np.int64)
            self._wait(dup.Iallreduce(MPI.IN_PLACE, [drawn, MPI.INT64_T], MPI.MAX),
                       "token agreement", None, timeout, serve=False)
            token = int(drawn[0])
        self.token = token
        # the agreements' exchange (exchange.py), its persistent Allgather made here:
        # every rank makes its duplicate, and so this, in the same order
        self.exchange = Exchange(self.size)
        self.exchange.request = _persistent_allgather(dup, self.exchange.buffers)
        _install_hooks()
        _live.add(self)

    def _duplicate(self, parent: MPI.Comm, timeout: Optional[float]) -> MPI.Comm:
        what = "communicator duplication (every rank must construct the Reducer)"
        try:
            dup, request = parent.Idup()
            self._wait(request, what, None, timeout, serve=False)
        except MPI.Exception:            # out of communicators: collect unfreed Reducers
            gc.collect()
            _free_retired(0)
            dup, request = parent.Idup()
            self._wait(request, what, None, timeout, serve=False)
        return dup

    def enter(self) -> None:
        """One call at a time (``leave`` ends it): collectives of two threads on
        one communicator would match each other's in any order."""
        if not self.busy.acquire(blocking=False):
            raise RuntimeError(
                "a Reducer (and every Reducer or broadcast on the same communicator) is used "
                "by one thread at a time; give each thread its own communicator, e.g. "
                "Reducer(comm=MPI.COMM_WORLD.Dup()) created in the same order on every rank")
        self.inside = True

    def leave(self) -> None:
        """The call ``enter`` began has ended."""
        self.inside = False
        if self.deadline is not None:
            self.deadline.stand_down()
        self.busy.release()

    def free(self) -> None:
        """Tell the peers this rank is done with the duplicate; free it once
        every peer's goodbye has arrived (Open MPI aborts on a message that
        reaches a freed communicator, so none may still be on its way)."""
        if self.comm == MPI.COMM_NULL:                    # abandoned already
            return
        if self.revocable and self.comm.Is_revoked():     # after a lost rank
            self.abandon()
            return
        self.take_notices()     # a peer that has ended since is not sent a goodbye
        self.goodbye("freed the group (its Reducer, process group or process set)", self.settled)
        _live.discard(self)
        _retired.append(self)
        _free_retired()

    def abandon(self) -> None:
        """The duplicate lost a rank: forget it (no goodbyes, no notices; kept,
        never freed: freeing a communicator with a failed rank, revoked or
        not, is not safe everywhere)."""
        self.left = True
        self.exit_phase = "done"
        _live.discard(self)
        if self.comm != MPI.COMM_NULL:
            _KEPT.append((self.comm, *self.adopted))
            self.adopted.clear()
            self.comm = MPI.COMM_NULL

    def adopt(self, comm: MPI.Comm) -> None:
        """Free ``comm`` (split from the duplicate) together with the duplicate."""
        self.adopted.append(comm)

    def release_if_done(self) -> bool:
        """Free the duplicate if every peer has said goodbye; whether it did.
        A tainted one is kept instead (not freed, so MPI never gives its
        context to a later communicator, whose first collectives would
        match the messages of the collective left incomplete: a stale
        agreement slot read as a peer's, the ranks then disagreeing)."""
        if MPI.Is_finalized():
            return True
        self._serve_outside_calls()
        if self.comm == MPI.COMM_NULL:          # abandoned
            return True
        if len(self.gone) < self.size - 1 or self.awaiting:
            return False
        if self.tainted:
            _KEPT.append((self.comm, *self.adopted))
            self.adopted.clear()
            self.comm = MPI.COMM_NULL
            return True
        for comm in self.adopted:
            _discard_unreceived(comm)
            comm.Free()
        self.adopted.clear()
        self.exchange.free()                    # (not tainted: no agreement in flight)
        self.comm.Free()
        self.comm = MPI.COMM_NULL
        return True

    # -- notices ---------------------------------------------------------
    def _send(self, rank: int, tag: int, payload: Any) -> None:
        """Send a notice without waiting for it to go out (a peer busy
        elsewhere may not take it in for a while)."""
        TALLY.notices += 1
        try:
            _outbox.append(self.comm.isend(payload, dest=rank, tag=tag))
        except MPI.Exception:       # the peer is gone already: nothing to tell
            pass
        _sent()

    def take_notices(self) -> bool:
        """Receive the notices that have arrived (at exit too); whether any had.
        Two polls: after an idle spell the first may only bring them in (MPICH's
        ofi/tcp reads its socket as it probes)."""
        came = False
        for _ in range(2):
            if self.comm == MPI.COMM_NULL or MPI.Is_finalized():
                break
            came |= self._serve_outside_calls()
        return came

    def heard_from_everyone(self) -> bool:
        """Whether every peer has said goodbye."""
        return self.comm == MPI.COMM_NULL or len(self.gone) >= self.size - 1

    def goodbye(self, reason: str, calls: int) -> None:
        """Tell every peer that this rank leaves the duplicate (once), having
        done the collectives of its first ``calls`` calls. Peers that freed
        theirs are told too (they keep it until every goodbye has arrived);
        peers whose program is ending are not: their exit's final notice to
        this rank may still come (awaited before the duplicate is freed, and
        before this rank's MPI_Finalize)."""
        if self.left or self.comm == MPI.COMM_NULL or MPI.Is_finalized():
            return
        self.left = True
        note = (self.token, reason[:_MAX_NOTICE], calls, False, self.tainted)
        for rank in range(self.size):
            said = self.gone.get(rank)
            if rank == self.rank or rank in self.ended:
                continue
            if said is not None and said[2]:
                if rank not in self.spread.final:
                    self.awaiting.add(rank)
                continue
            self._send(rank, _GOODBYE, note)

    def tell_ended(self, reason: str) -> None:
        """This rank's program ends (after ``exit_start``, for a live duplicate):
        tell the peers that may still send to it outside the tree's notices,
        unless they have ended: on a duplicate it left before (freed, or left
        with an abandoned call), those that have not said goodbye (they would
        say it later); on one it holds, those that left theirs (the tree passes
        them by, and they would tell this rank when theirs ends), and once the
        exit's phases are done, those not heard of at all (their programs go on:
        the tree's notices reach them only through ranks that serve it, and they
        would send a goodbye to this rank when they free theirs)."""
        if self.comm == MPI.COMM_NULL or MPI.Is_finalized():
            return
        held = self.held_at_exit
        unheard = not held or self.exit_phase == "done"    # peers not heard of: told
        calls = self.own[1] if held and self.own is not None else self.settled
        note = (self.token, reason[:_MAX_NOTICE], calls, True, self.tainted)
        for rank in range(self.size):
            said = self.gone.get(rank)
            if rank == self.rank or rank in self.ended or rank in self.spread.final or (
                    said is not None and said[2]):
                continue
            if (unheard and said is None) or (held and said is not None):
                self._tell_ended_to(rank, note)

    def _tell_ended_to(self, rank: int, note: Tuple[Any, ...]) -> None:
        """Tell ``rank`` directly (once) that this rank's program ended; its
        answer (its final or ended notice) is then awaited, or a quiet moment."""
        if rank not in self.told_ended:
            self._send(rank, _ENDED, note)
            self.told_ended.add(rank)
            self.awaiting.add(rank)

    # -- at exit: the departures along the tree (departures.py) --------------
    def exit_start(self, reason: str, calls: int) -> None:
        """This rank's program ends, having done the collectives of its first
        ``calls`` calls: its departure joins what it tells the tree."""
        self.held_at_exit = not self.left and self.comm != MPI.COMM_NULL
        self.exit_phase = "up" if self.held_at_exit else "done"
        self.left = True
        self.own = (reason[:_MAX_NOTICE], calls, True)
        self.last_notice = time.monotonic()

    @property
    def exit_done(self) -> bool:
        return self.exit_phase == "done"

    def exit_step(self, quiet_seconds: float) -> None:
        """Move the exit's phases on: up to the parent once the subtree's
        departures are known, the final notices once everyone's are (each
        after ``quiet_seconds`` without a notice at the latest)."""
        if self.exit_phase in ("", "done") or MPI.Is_finalized():
            return
        quiet = time.monotonic() - self.last_notice > quiet_seconds
        if self.exit_phase == "up":
            if quiet or all(rank in self.gone for rank in subtree(self.rank, self.size)):
                above = self.spread.up(self._passed_by())
                if above is not None:
                    self._tell(self.spread.notices(self._spreading(), [above]), final=False)
                self.exit_phase = "down"
                self.last_notice = time.monotonic()
        elif quiet or self.heard_from_everyone():
            self._tell_around(final=True)
            self.exit_phase = "done"
            assert self.own is not None
            self.tell_ended(self.own[0])

    def _spreading(self) -> Dict[int, Departure]:
        """The departures the tree carries: those of ending programs (a freed
        duplicate's goodbye went to every peer)."""
        known = {rank: said for rank, said in self.gone.items() if said[2]}
        if self.own is not None:
            known[self.rank] = self.own
        return known

    def _passed_by(self) -> Set[int]:
        """The ranks no departure is sent to (their neighbours are reached
        through them): those that left the duplicate, except, while this
        rank's program ends, those whose program ends too (they wait for
        it). A rank that freed its duplicate may have ended since: a send to
        an ended process can block for ever in a network transport
        (libfabric's tcp retries its connect)."""
        return {rank for rank, said in self.gone.items()
                if not self.exit_phase or not said[2]} | self.ended

    def _tell(self, notices: List[Tuple[int, Dict[int, Departure]]], final: bool) -> None:
        for rank, departures in notices:
            self._send(rank, _DEPARTURES, (self.token, final, pack(departures)))
            if final:       # (never to a neighbour whose own final notice came)
                self.awaiting.add(rank)

    def _tell_around(self, final: bool) -> None:
        """The departures each neighbour lacks, routed around the ranks passed by
        (at exit, a rank whose program ends only where it is a neighbour)."""
        known = self._spreading()
        ending = {rank for rank, said in self.gone.items() if said[2]} if self.exit_phase \
            else set()
        targets = self.spread.around(self._passed_by(), known, ending)
        self._tell(self.spread.notices(known, targets, final), final)

    def _pass_on(self) -> None:
        """A rank whose program goes on, about to raise PeerError: the ending
        programs' departures to every neighbour that lacks them (routed around
        ranks that left), so that those waiting in the call raise too. (Not
        as they come: a departure of a rank that completed the current call
        matters only to the next, whose check passes it on.)"""
        if not self.left:
            self._tell_around(final=False)

    def _serve_outside_calls(self) -> bool:
        """``_serve`` where no call waits (freeing, at exit): a lost rank the
        MPI library reports there abandons the duplicate instead of raising."""
        try:
            return self._serve()
        except MPI.Exception as exc:
            if not is_process_failure(exc):
                raise
            self.abandon()
            return False

    def _serve(self) -> bool:
        """Receive every pending notice; answer queries; whether any came."""
        status = MPI.Status()
        came = False
        while True:
            # a matched probe: a stale message, left for a freed duplicate whose
            # context the MPI library gave to this one, may even name a rank
            # this communicator does not have
            handle = self.comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if handle is None:
                return came
            came = True
            source, tag = status.Get_source(), status.Get_tag()
            message = handle.recv()
            if not isinstance(message, tuple) or message[0] != self.token:
                continue                     # stale: from an earlier duplicate
            self.last_notice = time.monotonic()
            if tag in (_GOODBYE, _ENDED):
                self.gone.setdefault(source, message[1:4])
                self.tainted |= bool(message[4])
                if tag == _ENDED:
                    self.ended.add(source)
                    self.awaiting.discard(source)
            elif tag == _DEPARTURES:
                departures = unpack(message[2]) or {}
                self.spread.heard(source, departures, bool(message[1]))
                if message[1]:
                    self.awaiting.discard(source)
                for rank, said in departures.items():
                    if rank != self.rank:
                        self.gone.setdefault(rank, said)
            elif tag == _QUERY:
                call, what = self.current or (None, None)
                self._send(source, _STATUS, (self.token, call, _text(what)))
            elif tag == _STATUS:
                self._answers[source] = message[1:]

    def _peer_error(self, call: int) -> Optional[PeerError]:
        """PeerError naming the ranks that left before completing call number
        ``call`` (they will not take part in its collectives); None if none."""
        if not self.gone:
            return None
        lost = {r: why for r, (why, finished, _) in self.gone.items() if finished < call}
        if not lost:
            return None
        ranks = sorted(lost)
        return PeerError(ranks, [lost[r] for r in ranks], "the group lost its peer")

    def check(self, call: int, timeout: Optional[float] = None) -> None:
        """Raise before a collective of call ``call`` (waited ``timeout``
        seconds at most) if a peer left before completing it, or if an earlier
        call had to abandon a collective."""
        if self.broken is not None:
            raise self.broken
        if self.deadline is not None and self.inside:
            self.deadline.renew(timeout)
        if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG):
            self._serve()
        error = self._peer_error(call)
        if error is not None:
            self._pass_on()
            raise error

    # -- the wait --------------------------------------------------------
    def wait(self, request: MPI.Request, what: What, call: int,
             timeout: Optional[float], peer: Optional[int] = None,
             status: Optional[MPI.Status] = None) -> None:
        """Complete ``request`` (its ``status`` filled in, where given): a
        PeerError when a peer leaves meanwhile (for a point-to-point message,
        when ``peer`` has left at all), a diagnostic and MPI_Abort when
        ``timeout`` seconds pass."""
        if self.deadline is not None and self.inside:
            self.deadline.renew(timeout)
        if request.Test(status):
            return
        self.current = (call, what)
        try:
            self._wait(request, what, call, timeout, peer=peer, status=status)
        except BaseException:
            self.tainted = True              # left incomplete
            raise
        finally:
            self.current = None

    def _wait(self, request: MPI.Request, what: What, call: Optional[int],
              timeout: Optional[float], serve: bool = True, peer: Optional[int] = None,
              status: Optional[MPI.Status] = None) -> None:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        comm = self.comm
        while not request.Test(status):
            if serve and call is not None and comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG):
                self._serve()
                # a peer that left after completing this call did its part
                # (its data may still be on its way): only one that left
                # before means the collective can never complete
                error = self._peer_error(call)
                if error is not None:
                    self.broken = error
                    self._pass_on()
                    raise error
            if peer is not None and peer in self.gone:
                self._last_message(request, what, peer)
                return
            if self.revocable and comm.Is_revoked():
                raise MPI.Exception(MPI.ERR_REVOKED)
            # yield the core: ranks sharing cores would otherwise spin
            # against the peer they wait for
            os.sched_yield()
            if deadline is not None and time.monotonic() > deadline:
                self._abort_stalled(what, time.monotonic() - start, call, timeout, serve,
                                    request)

    def test(self, request: MPI.Request, what: What, peer: Optional[int],
             status: Optional[MPI.Status] = None) -> bool:
        """Whether point-to-point ``request`` with ``peer`` is done (``status``
        filled in), serving the notices meanwhile: PeerError where the peer
        has left and its message is not on its way."""
        if request.Test(status):
            return True
        if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG):
            self._serve()
        if peer is not None and peer in self.gone:
            try:
                self._last_message(request, what, peer)
            except BaseException:
                self.tainted = True
                raise
            return True
        return False

    def _last_message(self, request: MPI.Request, what: What, peer: int) -> None:
        """``request``, a message with ``peer``, which has left: complete if
        its message was already on its way, else cancelled and a PeerError."""
        until = time.monotonic() + _LAST_MESSAGE_SECONDS
        while time.monotonic() < until:
            if request.Test():
                return
            time.sleep(0.001)
        request.Cancel()
        request.Wait()
        self._pass_on()
        raise PeerError([peer], [self.gone[peer][0]],
                        f"{_text(what)} cannot complete: its peer left,")

    def _ask_peers(self) -> Dict[int, Tuple[Any, ...]]:
        """{rank: (reducer id, call, what)} of the peers that answer in time."""
        self._answers = {}
        for rank in range(self.size):
            if rank != self.rank:
                self._send(rank, _QUERY, (self.token,))
        until = time.monotonic() + _ANSWER_SECONDS
        while len(self._answers) < self.size - 1 and time.monotonic() < until:
            if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG):
                self._serve()
            else:
                time.sleep(0.001)
        return self._answers

    def _abort_stalled(self, what: What, elapsed: float, call: Optional[int],
                       timeout: Optional[float], ask: bool, request: MPI.Request) -> NoReturn:
        """The stall's diagnostic, then MPI_Abort of the job (``on_stall``
        "abort") or TimedOut raised, the channel broken ("raise")."""
        where = "while the Reducer was constructed" if call is None else f"in call {call}"
        lines = [f"mpigrad: rank {self.rank} (world rank {MPI.COMM_WORLD.Get_rank()}): "
                 f"{_text(what)} did not complete within {timeout:g} s (waited {elapsed:.1f} s), "
                 f"{where}."]
        if ask and self.size > 1:
            answers = self._ask_peers()
            missing = []
            for rank in range(self.size):
                if rank == self.rank:
                    continue
                if rank in self.gone:
                    lines.append(f"  rank {rank}: {self.gone[rank][0]}")
                    missing.append(rank)
                elif rank not in answers:
                    lines.append(f"  rank {rank}: no answer: not inside a call of this "
                                 "group (computing, blocked elsewhere, or dead)")
                    missing.append(rank)
                else:
                    other_call, other_what = answers[rank]
                    lines.append(f"  rank {rank}: waiting in call {other_call}: {other_what}")
                    if other_call != call:
                        missing.append(rank)
            lines.append(f"  ranks that did not arrive: {missing}")
        elif not ask:
            lines.append("  the ranks that did not arrive cannot be asked before the Reducer's "
                         "own communicator exists: look for a rank that never constructed it "
                         "(every rank of the communicator must)")
        if self.on_stall == "raise":
            error = TimedOut("\n".join([lines[0] + " Timed out waiting for the peers: the "
                                         "group is unusable from now on; destroy it.",
                                         *lines[1:]]))
            self.broken = error              # every later call raises it
            _stranded.append(request)        # its buffers kept: MPI may still write them
            raise error
        lines.append("Aborting the job (Reducer(timeout=...) or MPIGRAD_TIMEOUT sets the limit).")
        # the process's own stderr: a redirection inside it (pytest's capture,
        # a logger) would die with the process before showing the message
        stream = sys.__stderr__ or sys.stderr
        stream.write("\n".join(lines) + "\n")
        stream.flush()
        time.sleep(0.5)              # let the launcher forward it before the job is torn down
        end_within(GRACE)            # the library may be too wedged to abort
        # the whole job, as the diagnostic says, whatever ranks this
        # communicator holds (a Horovod process set, a split of the world)
        MPI.COMM_WORLD.Abort(1)
        os._exit(1)                  # in case Abort returns before the job ends

    def __repr__(self) -> str:
        return f"Channel(rank={self.rank}, size={self.size})"

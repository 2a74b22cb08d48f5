"""Watching mpigrad's collectives so that no rank hangs silently.

One duplicate of each parent communicator (a Channel) is shared by every
Reducer built on that parent, so forgotten Reducers cannot exhaust the MPI
library's communicators. It is cached on the parent as an MPI attribute and
lives as long as the parent (freed with it): never freed when a rank happens to
drop its last Reducer, which ranks do at different times (garbage collection),
so every rank always agrees on which duplicate a new Reducer uses. Every collective on it is started
non-blocking and waited for in a loop that yields the core (ranks sharing cores
do not slow each other; as fast as the blocking call here) and that also
serves small point-to-point notices between ranks:

- goodbye: a rank whose program ends while it holds a live Reducer (normally,
  by an uncaught exception or sys.exit) or that frees one tells its peers; a
  peer waiting in, or entering, a collective of that Reducer raises PeerError
  naming the rank and what happened, instead of waiting forever;
- query / status: a rank whose collective passes the watchdog's timeout asks
  every peer where it is, and names in its diagnostic the ranks that did not
  arrive and every rank's call number, before it aborts the job.

Notices carry a token agreed when the Channel is made, so a stale notice that
outlives a freed duplicate is never taken for one of a later Channel.
"""

import atexit
import os
import sys
import time
import weakref

import numpy as np
from mpi4py import MPI

from .errors import PeerError

__all__ = ["Channel"]

_GOODBYE, _QUERY, _STATUS = 0x6D67, 0x6D68, 0x6D69      # message tags on a Channel
_ALL = None                   # a goodbye for every Reducer of a rank: it has left
_MAX_NOTICE = 900             # bytes: notices stay small (sent eagerly)
_ANSWER_SECONDS = 2.0         # how long a stalled rank waits for its peers' answers
_LOST_GRACE_SECONDS = 1.0     # how long a collective may still complete after a peer left

_keyval = []                  # the MPI attribute key caching {parent type: Channel}
_live = weakref.WeakSet()     # Channels to say goodbye on at exit
_uncaught = []                # the exception that is ending the program, if any
_hooked = False


def _record_uncaught(previous):
    def hook(kind, value, tb):
        _uncaught[:] = [f"by an uncaught {kind.__name__}: {value}"]
        previous(kind, value, tb)
    return hook


def _say_goodbye_at_exit():
    how = _uncaught[0] if _uncaught else "(returned or sys.exit)"
    for channel in list(_live):
        channel.goodbye(_ALL, f"its program ended {how}")


def _install_hooks():
    global _hooked
    if not _hooked:
        _hooked = True
        sys.excepthook = _record_uncaught(sys.excepthook)
        atexit.register(_say_goodbye_at_exit)   # runs before mpi4py's MPI_Finalize


def _parent_freed(parent, keyval, cached):
    for channel in cached.values():
        channel.free()


def _text(what):
    return what() if callable(what) else what


class Channel:
    """The shared duplicate of one parent communicator, and its watch.

    Use ``Channel.acquire(parent, timeout)``; each acquirer gets a Reducer id,
    equal on every rank (construction is collective and in program order).
    """

    def __init__(self, parent, timeout):
        self.rank, self.size = parent.Get_rank(), parent.Get_size()
        self.comm = parent                   # until the duplicate exists
        self.refs = 0
        self.next_id = 0
        self.gone = {}                       # rank -> why it left
        self.freed = {}                      # (rank, reducer id) -> why
        self.broken = None                   # a PeerError once a collective was abandoned
        self.current = None                  # (reducer id, call, what) while waiting
        self._answers = {}                   # rank -> its status, while asking
        self.helper = None                   # the Communicator of mpigrad's free functions
        dup, request = parent.Idup()
        self._wait(request, "communicator duplication (every rank must construct the Reducer)",
                   None, 0, timeout)
        dup.Set_errhandler(MPI.ERRORS_RETURN)
        self.comm = dup
        token = np.random.default_rng().integers(1, 1 << 62, size=1, dtype=np.int64)
        self._wait(dup.Iallreduce(MPI.IN_PLACE, [token, MPI.INT64_T], MPI.MAX),
                   "token agreement", None, 0, timeout)
        self.token = int(token[0])
        _install_hooks()
        _live.add(self)

    @classmethod
    def acquire(cls, parent, timeout):
        """(the Channel of ``parent``, a new Reducer id on it)."""
        if not _keyval:
            _keyval.append(MPI.Comm.Create_keyval(delete_fn=_parent_freed))
        cached = parent.Get_attr(_keyval[0])
        if cached is None:
            cached = {}
            parent.Set_attr(_keyval[0], cached)
        channel = cached.get(type(parent))        # a wrapper class gets its own
        if channel is None:
            channel = cached[type(parent)] = cls(parent, timeout)
        channel.refs += 1
        channel.next_id += 1
        return channel, channel.next_id - 1

    @staticmethod
    def peek(parent):
        """The Channel of ``parent`` if one exists (nothing is created)."""
        if not _keyval:
            return None
        cached = parent.Get_attr(_keyval[0])
        return None if cached is None else cached.get(type(parent))

    def release(self, reducer_id):
        """A Reducer is freed: tell the peers (its twins raise if used again)."""
        self.goodbye(reducer_id, "freed its Reducer")
        self.refs -= 1

    def free(self):
        """Free the duplicate (when its parent is freed)."""
        _live.discard(self)
        if self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()
        self.comm = MPI.COMM_NULL

    # -- notices ---------------------------------------------------------
    def _send(self, rank, tag, payload):
        try:
            self.comm.send(payload, dest=rank, tag=tag)
        except MPI.Exception:       # the peer is gone already: nothing to tell
            pass

    def goodbye(self, reducer_id, reason):
        """Tell every peer still here that this rank frees ``reducer_id`` (or
        leaves, with _ALL)."""
        if self.comm == MPI.COMM_NULL or MPI.Is_finalized():
            return
        note = (self.token, reducer_id, reason[:_MAX_NOTICE])
        for rank in range(self.size):
            if rank != self.rank and rank not in self.gone:
                self._send(rank, _GOODBYE, note)

    def _serve(self):
        """Receive every pending notice; answer queries."""
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            source, tag = status.Get_source(), status.Get_tag()
            message = self.comm.recv(source=source, tag=tag)
            if message[0] != self.token:
                continue                     # stale: from an earlier duplicate
            if tag == _GOODBYE:
                _, reducer_id, reason = message
                if reducer_id is _ALL:
                    self.gone[source] = reason
                else:
                    self.freed[(source, reducer_id)] = reason
            elif tag == _QUERY:
                rid, call, what = self.current or (None, None, None)
                self._send(source, _STATUS, (self.token, rid, call, _text(what)))
            elif tag == _STATUS:
                self._answers[source] = message[1:]

    def _peer_error(self, reducer_id):
        """PeerError for ranks that left, or freed ``reducer_id``; else None."""
        lost = {r: why for r, why in self.gone.items()}
        lost.update({r: why for (r, rid), why in self.freed.items()
                     if rid == reducer_id and r not in lost})
        if not lost:
            return None
        ranks = sorted(lost)
        return PeerError(ranks, [lost[r] for r in ranks], "the Reducer lost its peer")

    def check(self, reducer_id):
        """Raise before a call if a peer left or freed this Reducer, or if an
        earlier call had to abandon a collective."""
        if self.broken is not None:
            raise self.broken
        if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG):
            self._serve()
        error = self._peer_error(reducer_id)
        if error is not None:
            raise error

    # -- the wait --------------------------------------------------------
    def wait(self, request, what, reducer_id, call, timeout):
        """Complete ``request``: a PeerError when a peer leaves meanwhile, a
        diagnostic and MPI_Abort when ``timeout`` seconds pass."""
        if request.Test():
            return
        self.current = (reducer_id, call, what)
        try:
            self._wait(request, what, reducer_id, call, timeout)
        finally:
            self.current = None

    def _wait(self, request, what, reducer_id, call, timeout):
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        comm, lost = self.comm, None
        while not request.Test():
            if reducer_id is not None and (lost is not None or
                                           comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)):
                self._serve()
                error = self._peer_error(reducer_id)
                if error is not None:
                    # a peer that left may still have finished its part of this
                    # collective (completion is local): wait a little longer
                    lost = lost or time.monotonic()
                    if time.monotonic() - lost > _LOST_GRACE_SECONDS:
                        self.broken = error          # it can never complete
                        raise error
            # yield the core: ranks sharing cores would otherwise spin
            # against the peer they wait for
            os.sched_yield()
            if deadline is not None and time.monotonic() > deadline:
                self._abort_stalled(what, time.monotonic() - start, reducer_id, call, timeout)

    def _ask_peers(self):
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

    def _abort_stalled(self, what, elapsed, reducer_id, call, timeout):
        what = _text(what)
        lines = [f"mpigrad: rank {self.rank} (world rank {MPI.COMM_WORLD.Get_rank()}): "
                 f"{what} did not complete within {timeout:g} s (waited {elapsed:.1f} s), "
                 f"in call {call} of Reducer {reducer_id}."]
        if reducer_id is not None and self.comm.Get_size() > 1:
            answers = self._ask_peers()
            missing = []
            for rank in range(self.size):
                if rank == self.rank:
                    continue
                if rank in self.gone:
                    lines.append(f"  rank {rank}: {self.gone[rank]}")
                    missing.append(rank)
                elif rank not in answers:
                    lines.append(f"  rank {rank}: no answer: not inside an mpigrad call "
                                 "(computing, blocked elsewhere, or dead)")
                    missing.append(rank)
                else:
                    rid, other_call, other_what = answers[rank]
                    lines.append(f"  rank {rank}: waiting in call {other_call} of Reducer "
                                 f"{rid}: {other_what}")
                    if (rid, other_call) != (reducer_id, call):
                        missing.append(rank)
            lines.append(f"  ranks that did not arrive: {missing}")
        lines.append("Aborting the job (Reducer(timeout=...) or MPIGRAD_TIMEOUT sets the limit).")
        # the process's own stderr: a redirection inside it (pytest's capture,
        # a logger) would die with the process before showing the message
        stream = sys.__stderr__ or sys.stderr
        stream.write("\n".join(lines) + "\n")
        stream.flush()
        self.comm.Abort(1)
        os._exit(1)                  # in case Abort returns before the job ends

    def __repr__(self):
        return f"Channel(rank={self.rank}, size={self.size}, refs={self.refs})"

"""Pieces of a sum in flight: each summed by one collective or two (the bfloat16 wire),
started in the same order on every rank however each rank's tests come out."""

import atexit
import threading
import time
import weakref
from collections import deque
from typing import Callable, Deque, Iterator, Optional, Protocol, Tuple

import numpy as np
from mpi4py import MPI

from .._base.ranges import pieces
from .._comm.communicator import Communicator, Started, What
from .wire import WINDOW, WireSum, compresses

__all__ = ["TwoStage", "OneCollective", "Then", "InFlight", "Sums"]


class TwoStage(Protocol):
    """A piece summed by one collective, or two (WireSum), for an InFlight window."""

    def test_first(self) -> bool: ...
    def wait_first(self) -> None: ...
    def start_second(self) -> None: ...
    def test_second(self) -> bool: ...
    def wait_second(self) -> None: ...


class InFlight:
    """Pieces in flight, at most ``window`` of them in their first collective, whose
    collectives start in the same order on every rank (MPI's rule for a communicator),
    whenever each rank happens to find one done: A1..Aw, then the second collective of the
    oldest (after its first is done) before the next piece's first, and so on."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.first: Deque[TwoStage] = deque()
        self.second: Deque[TwoStage] = deque()

    def room(self) -> bool:
        """Whether the next piece's first collective may start now."""
        return len(self.first) < self.window

    def add(self, piece: TwoStage) -> None:
        self.first.append(piece)

    def step(self, block: bool) -> bool:
        """Move on by one start (with ``block``, waiting for it; pass it only once no more
        pieces will be added); whether anything moved."""
        while self.second and self.second[0].test_second():
            self.second.popleft()
        if self.first and (block or not self.room()):
            head = self.first[0]
            if block:
                head.wait_first()
            elif not head.test_first():
                return False
            self.first.popleft()
            head.start_second()
            self.second.append(head)
            return True
        if block and self.second:
            self.second.popleft().wait_second()
            return True
        return False


class OneCollective:
    """A piece summed by one started collective (an Iallreduce), as a TwoStage."""

    def __init__(self, comm: Communicator, started: Started) -> None:
        self.comm, self.started = comm, started

    def test_first(self) -> bool:
        done: bool = self.started.request.Test()
        return done

    def wait_first(self) -> None:
        self.comm.wait(self.started)

    def start_second(self) -> None:
        pass

    def test_second(self) -> bool:
        return True

    def wait_second(self) -> None:
        pass


class Then:
    """``piece``, with ``done()`` called once it has finished (as a TwoStage)."""

    def __init__(self, piece: TwoStage, done: Callable[[], None]) -> None:
        self.piece, self.done = piece, done

    def test_first(self) -> bool:
        return self.piece.test_first()

    def wait_first(self) -> None:
        self.piece.wait_first()

    def start_second(self) -> None:
        self.piece.start_second()

    def test_second(self) -> bool:
        if not self.piece.test_second():
            return False
        self.done()
        return True

    def wait_second(self) -> None:
        self.piece.wait_second()
        self.done()


def _nothing() -> None:
    pass


#: how often a poller moves an overlapped call's pieces on (0.1 ms: 1 ms hid less than half
#: as much of ResNet-50's sum across 2 nodes behind a 300 ms backward)
_POLL_SECONDS = 1e-4


class Sums:
    """1-D pieces summed in place over a communicator, in flight: one Iallreduce at a time
    (MPICH runs many outstanding ones slower than the same calls one after another), or up
    to ``wire.WINDOW`` pieces where the Reducer has a wire (a WireSum's shares are summed
    between its two collectives) or a poller. Pieces queue in ``add`` and start as the
    window allows, in the same order on every rank (``progress``; ``finish`` waits for all
    of them).

    MPI moves a non-blocking collective on only inside MPI calls. An overlapped call's
    pieces (``poll``) are therefore also moved on by a thread while any are pending,
    every _POLL_SECONDS: backward's own kernels (torch's autograd, numpy) release the GIL,
    and the thread's MPI calls run meanwhile. The pieces' collectives start in the same
    order whichever thread starts them (the InFlight rule, under one lock).

    Args:
        communicator: the Reducer's Communicator (watched).
        wire: the Reducer's wire setting.
        comm: a communicator split from it (the ranks across nodes), default its own.
        poll: move pieces on from a thread too (an overlapped call).
    """

    def __init__(self, communicator: Communicator, wire: Optional[str],
                 comm: Optional[MPI.Comm] = None, poll: bool = False) -> None:
        self.communicator, self.wire, self.comm = communicator, wire, comm
        # more pieces in flight where each waits for its sum (the wire) or for the next
        # poll: the link stays busy between two moves
        self.flight = InFlight(WINDOW if wire is not None or poll else 1)
        self.queue: Deque[Tuple[np.ndarray, What, Callable[[], None]]] = deque()
        self.poll = poll
        self.lock = threading.Lock()
        self.poller: Optional[threading.Thread] = None
        self.closed = False
        self.failure: Optional[Exception] = None      # what the poller met

    def cuts(self, flat: np.ndarray) -> Iterator[Tuple[int, int]]:
        """[lo, hi) of the pieces of ``flat``: at most the Reducer's chunk_bytes each."""
        return pieces(flat.size, flat.itemsize, self.communicator.chunk_bytes)

    def add(self, piece: np.ndarray, what: What, done: Callable[[], None] = _nothing) -> None:
        """Queue the 1-D ``piece``; ``done()`` once it is summed."""
        with self.lock:
            self.queue.append((piece, what, done))

    def make_room(self) -> None:
        """Wait until the next piece can start at once."""
        while not self.flight.room():
            self.flight.step(block=True)

    def progress(self) -> None:
        """Start queued pieces as the window allows, without blocking."""
        with self.lock:
            self._pump(block=False)
            pending = bool(self.queue or self.flight.first or self.flight.second)
        if self.poll and pending and (self.poller is None or not self.poller.is_alive()):
            self.poller = threading.Thread(target=self._polling, daemon=True,
                                           name="mpigrad progress")
            self.poller.start()

    def finish(self) -> None:
        """Sum every piece added (call it once no more will be); an error the poller
        met is raised here."""
        self.close()
        if self.failure is not None:
            raise self.failure
        self._pump(block=True)

    def close(self) -> None:
        """Stop the poller (it ends by itself once nothing is pending)."""
        self.closed = True
        if self.poller is not None:
            self.poller.join()
            _POLLING.discard(self)

    def _polling(self) -> None:
        _POLLING.add(self)
        while not self.closed:
            with self.lock:
                try:
                    self._pump(block=False)
                except Exception as exc:   # a peer that left (PeerError), a lost rank
                    self.failure = exc
                    return
                if not (self.queue or self.flight.first or self.flight.second):
                    return
            time.sleep(_POLL_SECONDS)

    def _pump(self, block: bool) -> None:
        while True:
            while self.queue and self.flight.room():
                piece, what, done = self.queue.popleft()
                started: TwoStage = (
                    WireSum(self.communicator, piece, what, self.comm, self.wire)
                    if self.wire is not None and compresses(self.wire, piece.dtype) else
                    OneCollective(self.communicator,
                                  self.communicator.start_sum(piece, what, self.comm)))
                self.flight.add(Then(started, done))
            if not self.flight.step(block):
                return


#: Sums whose poller may still run: stopped before MPI is finalized (a call left pending
#: by an error); atexit runs this module's handler before mpi4py's, registered earlier
_POLLING: "weakref.WeakSet[Sums]" = weakref.WeakSet()


@atexit.register
def _stop_pollers() -> None:
    """Stop every poller still running (at exit, before MPI is finalized)."""
    for sums in list(_POLLING):
        sums.close()

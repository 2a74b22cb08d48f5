"""Pieces of a sum in flight: each summed by one collective or two (the bfloat16 wire),
started in the same order on every rank however each rank's tests come out."""

from collections import deque
from typing import Callable, Deque, Iterator, Optional, Protocol, Tuple

import numpy as np
from mpi4py import MPI

from .._comm.communicator import Communicator, Started, What
from .wire import WINDOW, WireSum, compresses

__all__ = ["TwoStage", "OneCollective", "Then", "Pipeline", "Sums"]


class TwoStage(Protocol):
    """A piece summed by one collective, or two (WireSum), for a Pipeline."""

    def test_first(self) -> bool: ...
    def wait_first(self) -> None: ...
    def start_second(self) -> None: ...
    def test_second(self) -> bool: ...
    def wait_second(self) -> None: ...


class Pipeline:
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


class Sums:
    """1-D pieces summed in place over a communicator, in flight: one Iallreduce at a time
    (MPICH runs many outstanding ones slower than the same calls one after another), or up
    to ``wire.WINDOW`` pieces where the Reducer has a wire (a WireSum's shares are summed
    between its two collectives). Pieces queue in ``add`` and start as the window allows,
    in the same order on every rank (``progress``; ``finish`` waits for all of them).

    Args:
        communicator: the Reducer's Communicator (watched).
        wire: the Reducer's wire setting.
        comm: a communicator split from it (the ranks across nodes), default its own.
    """

    def __init__(self, communicator: Communicator, wire: Optional[str],
                 comm: Optional[MPI.Comm] = None) -> None:
        self.communicator, self.wire, self.comm = communicator, wire, comm
        self.flight = Pipeline(WINDOW if wire is not None else 1)
        self.queue: Deque[Tuple[np.ndarray, What, Callable[[], None]]] = deque()

    def cuts(self, flat: np.ndarray) -> Iterator[Tuple[int, int]]:
        """[lo, hi) of the pieces of ``flat``: at most the Reducer's chunk_bytes each."""
        step = max(1, self.communicator.chunk_bytes // flat.itemsize)
        return ((lo, min(lo + step, flat.size)) for lo in range(0, flat.size, step))

    def add(self, piece: np.ndarray, what: What, done: Callable[[], None] = _nothing) -> None:
        """Queue the 1-D ``piece``; ``done()`` once it is summed."""
        self.queue.append((piece, what, done))

    def make_room(self) -> None:
        """Wait until the next piece can start at once."""
        while not self.flight.room():
            self.flight.step(block=True)

    def progress(self) -> None:
        """Start queued pieces as the window allows, without blocking."""
        self._pump(block=False)

    def finish(self) -> None:
        """Sum every piece added (call it once no more will be)."""
        self._pump(block=True)

    def _pump(self, block: bool) -> None:
        while True:
            while self.queue and self.flight.room():
                piece, what, done = self.queue.popleft()
                started: TwoStage = (
                    WireSum(self.communicator, piece, what, self.comm)
                    if compresses(self.wire, piece.dtype) else
                    OneCollective(self.communicator,
                                  self.communicator.start_sum(piece, what, self.comm)))
                self.flight.add(Then(started, done))
            if not self.flight.step(block):
                return

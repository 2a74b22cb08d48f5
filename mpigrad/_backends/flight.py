"""Pieces of a sum in flight: each summed by one collective or two (the bfloat16 wire),
started in the same order on every rank however each rank's tests come out."""

from collections import deque
from typing import Callable, Deque, Protocol

from .._comm.communicator import Communicator, Started

__all__ = ["TwoStage", "OneCollective", "Then", "Pipeline"]


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

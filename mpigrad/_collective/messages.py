"""Point-to-point messages between the ranks of a group: sends and receives
started through the watch on the group's own split (``post``), a
``Message`` to wait for or test, and gloo's monitored barrier as messages
(``arrivals``). Not collectives: nothing is agreed first, so a message
that is never matched is the caller's to bound (torch's Work timeout)."""

import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .._comm.communicator import Communicator, Started
from .memory import as_bytes

__all__ = ["Message", "post", "arrivals"]


def post(comm: Communicator, pairs: MPI.Intracomm, name: str, arrays: Sequence[np.ndarray],
         peer: Optional[int], tag: int, what: str) -> "Message":
    """Start sending ("Send") ``arrays`` to ``peer``, or receiving ("Recv")
    into them from it (None: from whichever rank sends first; one array),
    one message each, in order, over ``pairs`` (the group's split for
    messages); the Message, to ``wait`` for or ``test``."""
    if peer is None and len(arrays) != 1:
        raise ValueError(f"{what}: a receive from any rank takes one tensor, got "
                         f"{len(arrays)}")
    source = MPI.ANY_SOURCE if peer is None else peer
    buffers = [as_bytes(a) for a in arrays]
    started = [comm.start_message(name, b, source, tag, what, pairs) for b in buffers]
    return Message(comm, started, buffers, peer, what)


def arrivals(comm: Communicator, pairs: MPI.Intracomm, seconds: Optional[float],
             tag: int) -> List[int]:
    """A barrier that can run out of time without harm, as gloo's monitored
    barrier: every rank messages rank 0, which answers each once all came.
    The ranks missing after ``seconds`` (on rank 0: those that did not
    come; elsewhere: [0] where rank 0 did not answer); [] once all came.
    No collective: the group stays usable either way."""
    token = np.zeros(1, np.uint8)
    deadline = None if seconds is None else time.monotonic() + seconds

    def message(name: str, peer: int, what: str) -> Message:
        return post(comm, pairs, name, [np.zeros(1, np.uint8) if name == "Recv" else token],
                    peer, tag, what)
    waiting: Dict[int, Message]
    if comm.rank == 0:
        waiting = {r: message("Recv", r, f"arrival of rank {r}") for r in range(1, comm.size)}
    else:
        message("Send", 0, "arrival at rank 0").wait()
        waiting = {0: message("Recv", 0, "rank 0's answer")}
    while waiting and (deadline is None or time.monotonic() < deadline):
        waiting = {r: m for r, m in waiting.items() if not m.test()}
        time.sleep(0.0005)
    for pending in waiting.values():
        pending.cancel()
    if comm.rank == 0 and not waiting:
        for r in range(1, comm.size):
            message("Send", r, f"answer to rank {r}").wait()
    return sorted(waiting)


class Message:
    """Point-to-point messages in flight (``post``): ``wait`` for them
    (watched), or ``test`` them until done; ``peer`` then names the other
    rank (the sender, for a receive from any rank). A peer that has left
    raises PeerError; a message larger than its receiving array, ValueError."""

    def __init__(self, communicator: Communicator, started: Sequence[Started],
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

    def _waited(self, started: Started, status: MPI.Status) -> bool:
        self.communicator.wait(started, status)
        return True

    def cancel(self) -> None:
        """Withdraw the messages not yet done (their group is going away)."""
        for started in self.started:
            started.request.Cancel()
            started.request.Wait()
        self.started.clear()

    def _complete(self, step: Callable[[Started, MPI.Status], bool]) -> bool:
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

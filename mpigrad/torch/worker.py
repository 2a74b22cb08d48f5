"""The thread that runs a torch process group's calls, and the Works it hands
torch.

A group's collectives run one after another, in the order they were made (the
order every rank makes them: MPI's rule for a communicator), on a thread of
its own, so that a Work returned to torch can still be running: DDP's bucket
all_reduces go on behind the rest of backward (whose kernels release the
GIL). Point-to-point messages are posted in that order and completed as they
can be, beside the later calls: ``batch_isend_irecv`` in any order, a recv
before its send on both ranks, cannot deadlock.

A failed call completes its Work's future in error, as gloo's C++ Work does
(torch's C++ readers, DDP's reducer among them, raise a RuntimeError naming
it), and ``Work.wait`` raises the call's own error.
"""

import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, List, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .._base.errors import TimedOut
from .._collective import Message

__all__ = ["Done", "Queued", "Worker"]

#: how long the worker sleeps between polls of messages in flight, when idle
_POLL_SECONDS = 0.0005


class _Failed:
    """What a queued call raised, as the result of its source future."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _outcome(source: torch.futures.Future) -> Any:
    """The result of a queued call, or its error raised: run as the callback
    of the Work's future, so that torch's C++ side sees a future in error
    where ``Future.set_exception`` would hand it an exception object as the
    value (DDP reads that as tensors and crashes)."""
    value = source.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class Done(dist.Work):
    """A call completed already (on the caller's thread), as torch's Work:
    ``wait`` returns at once, or raises what the call raised (its own type);
    the future, made when asked for (a blocking call never asks: a small
    call pays for every microsecond), holds its result, in error where it
    failed, as a Queued's does."""

    error: Optional[BaseException] = None
    future: Optional[torch.futures.Future] = None        # (set where asked for)

    def __init__(self, result: Any, error: Optional[BaseException] = None) -> None:
        super().__init__()
        self.value = result
        if error is not None:
            self.error = error

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if self.error is not None:
            raise self.error
        return True

    def result(self) -> Any:
        """What the call returned (its error raised)."""
        self.wait()
        return self.value

    def get_future(self) -> torch.futures.Future:
        if self.future is None:
            source: torch.futures.Future = torch.futures.Future()
            source.set_result(self.value if self.error is None else _Failed(self.error))
            self.future = source if self.error is None else source.then(_outcome)
        return self.future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self.error is None


class Queued(dist.Work):
    """A call queued on a Worker, as torch's Work: ``wait`` waits for it and
    raises what it raised (its own type); the future completes with it, in
    error where it failed.

    Args:
        what: the call, as a timeout names it.
        limit: seconds ``wait`` waits at most when not given a timeout (a
            message's: the group's timeout; None: a collective's, whose watch
            bounds it).
    """

    def __init__(self, what: str, limit: Optional[float] = None) -> None:
        super().__init__()
        self.what = what
        self.limit = limit
        self.source: torch.futures.Future = torch.futures.Future()
        # torch's future of it, made when asked for (a blocking call never is)
        self.future: Optional[torch.futures.Future] = None
        self.message: Optional[Message] = None

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        seconds = timeout.total_seconds() if timeout else self.limit
        if seconds is None:
            self.source.wait()
        elif not self._done_within(seconds):
            raise TimedOut(f"{self.what}: Timed out waiting {seconds:g} s (the Work stays "
                           "pending; for a message, its peer never matched it)")
        value = self.source.value()
        if isinstance(value, _Failed):
            raise value.error
        return True

    def _done_within(self, seconds: float) -> bool:
        """Whether the call is done within ``seconds``."""
        done = threading.Event()
        self.source.add_done_callback(lambda _: done.set())
        return done.wait(seconds)

    def result(self) -> Any:
        """What the call returned (waited for; its error raised)."""
        self.wait()
        return self.source.value()

    def get_future(self) -> torch.futures.Future:
        if self.future is None:
            self.future = self.source.then(_outcome)
        return self.future

    def is_completed(self) -> bool:
        return bool(self.source.done())

    def is_success(self) -> bool:
        return self.source.done() and not isinstance(self.source.value(), _Failed)

    def _source_rank(self) -> int:
        """The sender of a receive from any rank (torch's ``recv(src=None)``)."""
        if self.message is None or self.message.peer is None:
            raise RuntimeError(f"{self.what}: the sender is known once the receive is done")
        return self.message.peer

    def succeed(self, result: Any) -> None:
        self.source.set_result(result)

    def fail(self, error: BaseException) -> None:
        self.source.set_result(_Failed(error))


class _Item(NamedTuple):
    """A queued call: what it runs, its Work, and, for a message, what its
    Work gives once the message is done (``run`` then returns the Message)."""

    run: Callable[[], Any]
    work: Queued
    message_result: Any = None
    is_message: bool = False


class Worker:
    """The thread that runs a group's calls (see the module)."""

    def __init__(self, name: str) -> None:
        self.calls: "queue.Queue[Optional[_Item]]" = queue.Queue()
        self.posted: List[_Item] = []        # messages in flight, in the order posted
        self.state = threading.Lock()        # guards ``waiting`` and ``posted``
        self.waiting = 0                     # calls submitted and not yet run
        self.running = threading.Lock()      # held while a call runs, on either thread
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"mpigrad group {name}")
        self.thread.start()

    def submit(self, call: Callable[[], Any], what: str,
               small: bool = False) -> Union[Queued, Done]:
        """Queue ``call``; its Work (its future holds what ``call`` returns). A
        ``small`` call runs at once on the caller's thread where nothing is
        queued, running or in flight (no hand-off: the same order), and its
        Work is Done when it returns."""
        # inline: the running lock taken at once, with nothing queued (a call queued
        # counts in ``waiting`` from its submit on: it runs first) nor in flight; a
        # submit from another thread meanwhile finds the lock held and queues
        if small and self.running.acquire(blocking=False):
            try:
                if self.waiting == 0 and not self.posted:
                    try:
                        result = call()
                    except BaseException as exc:         # the caller's wait raises it
                        return Done(None, exc)
                    return Done(result)
            finally:
                self.running.release()
        work = Queued(what)
        with self.state:
            self.waiting += 1
            self.calls.put(_Item(call, work))
        return work

    def post(self, start: Callable[[], Message], result: Any, what: str,
             limit: Optional[float]) -> Queued:
        """Queue ``start`` of a message (it returns the Message); its Work,
        done with ``result`` once the message is (``wait`` bounded by ``limit``)."""
        work = Queued(what, limit)
        with self.state:
            self.waiting += 1
            self.calls.put(_Item(start, work, result, is_message=True))
        return work

    def stop(self) -> None:
        """Finish the queued calls, withdraw the messages still in flight (their
        Works fail), then end the thread."""
        self.calls.put(None)
        self.thread.join()

    def _serve(self) -> None:
        while True:
            try:
                item = self.calls.get(block=not self.posted)
            except queue.Empty:
                self._progress()
                time.sleep(_POLL_SECONDS)
                continue
            if item is None:
                self._withdraw()
                return
            self._execute(item)
            self._progress()

    def _execute(self, item: _Item) -> None:
        """Run one queued call (one at a time with the caller's small ones); its
        Work succeeds or fails with it; a message's goes in flight."""
        with self.running:
            try:
                result = item.run()
            except BaseException as exc:         # the caller's wait raises it
                failed: Optional[BaseException] = exc
            else:
                failed = None
            with self.state:
                self.waiting -= 1
                if failed is None and item.is_message:
                    item.work.message = result
                    self.posted.append(item)
        if failed is not None:
            item.work.fail(failed)
        elif not item.is_message:
            item.work.succeed(result)

    def _progress(self) -> None:
        """Complete the messages in flight that can be (their Works completed
        outside the lock: a future's callback may make the next call)."""
        done: List[Tuple[_Item, Optional[BaseException]]] = []
        with self.state:
            still = []
            for item in self.posted:
                assert item.work.message is not None
                try:
                    if item.work.message.test():
                        done.append((item, None))
                    else:
                        still.append(item)
                except BaseException as exc:
                    done.append((item, exc))
            self.posted = still
        for item, error in done:
            if error is None:
                item.work.succeed(item.message_result)
            else:
                item.work.fail(error)

    def _withdraw(self) -> None:
        for item in self.posted:
            assert item.work.message is not None
            item.work.message.cancel()
            item.work.fail(RuntimeError(f"{item.work.what}: its group was destroyed before "
                                        "the message completed"))
        self.posted = []

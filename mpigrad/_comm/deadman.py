"""Ending this process where the MPI library itself is stuck.

The watchdog (watch.py) ends a stalled collective with MPI_Abort, from
Python: that needs the GIL and an MPI library that still answers. After a
lost rank, Open MPI 5.0.11 can wedge inside the library (an MPI_Iprobe or a
revoke stuck in its tcp transport, MPI_Finalize waiting for the lost ranks),
where neither is to be had. These deadlines need neither: faulthandler's
watchdog thread (C, no GIL) writes every thread's stack to stderr and ends
the process with status 1; at interpreter exit, where no thread runs any
more, SIGALRM's default action (the kernel) ends it. faulthandler has one
such deadline per process: the last one set wins.
"""

import atexit
import faulthandler
import signal
import time
from contextlib import contextmanager
from typing import Iterator, Optional

__all__ = ["Deadline", "bounded", "end_within", "bound_finalize", "ended_after", "GRACE",
           "FINALIZE_GRACE"]

#: seconds past a step's own timeout before the process is ended from below
GRACE = 15.0
#: seconds MPI_Finalize may take at exit once a rank was lost
FINALIZE_GRACE = 10

_STDERR = 2
_finalize_bounded = False


def end_within(seconds: float) -> None:
    """End the process ``seconds`` from now, whatever it is doing then (before
    an MPI_Abort that may never return)."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=_STDERR)


@contextmanager
def bounded(seconds: Optional[float]) -> Iterator[None]:
    """End the process (its stacks on stderr, status 1) unless the block is
    left within ``seconds`` (None: no bound)."""
    if seconds is None:
        yield
        return
    end_within(seconds)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


class Deadline:
    """The process ends if a watched wait stays inside the MPI library for
    GRACE seconds past its timeout. Setting faulthandler's deadline costs a
    thread start (about 50 us), so it is set only when the one in force is
    more than GRACE / 2 seconds old (still GRACE / 2 past any wait's timeout),
    and cancelled when the call ends."""

    def __init__(self) -> None:
        self.set_at: Optional[float] = None
        self.seconds: Optional[float] = None

    def renew(self, timeout: Optional[float]) -> None:
        """A wait of at most ``timeout`` seconds (None: unbounded) begins."""
        if timeout is None:
            return
        now = time.monotonic()
        if (self.set_at is None or now - self.set_at > GRACE / 2
                or self.seconds != timeout + GRACE):
            self.seconds = timeout + GRACE
            end_within(self.seconds)
            self.set_at = now

    def stand_down(self) -> None:
        """The call ended: no deadline."""
        if self.set_at is not None:
            faulthandler.cancel_dump_traceback_later()
            self.set_at = None


def bound_finalize() -> None:
    """A rank was lost: at exit, give MPI_Finalize (mpi4py's, after every
    atexit handler) FINALIZE_GRACE seconds, then let the kernel end the
    process (Open MPI 5.0.11 sometimes waits there for the lost ranks for
    ever, and the job with it)."""
    global _finalize_bounded
    if not _finalize_bounded:
        _finalize_bounded = True
        atexit.register(_alarm_at_exit)


@contextmanager
def ended_after(seconds: int) -> Iterator[None]:
    """The block (in the main thread, at exit) ends the process if it runs
    past ``seconds``: SIGALRM's default action, which a call blocked inside
    the MPI library cannot hold up (a send to a peer that has ended can
    block for ever in a network transport: libfabric's tcp retries its
    connect). The previous handler and alarm come back after it."""
    handler = signal.signal(signal.SIGALRM, signal.SIG_DFL)
    left = signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(left)
        signal.signal(signal.SIGALRM, handler)


def _alarm_at_exit() -> None:
    signal.signal(signal.SIGALRM, signal.SIG_DFL)   # no Python handler runs from here on
    signal.alarm(FINALIZE_GRACE)

"""What the benchmark is doing, on rank 0's stderr: a line as each phase
begins, with the time since the benchmark started (the wall clock's), and
again at least every 10 s while a phase goes on (a thread keeps the line
coming while a long case runs)."""

import sys
import threading
import time
from typing import Optional

__all__ = ["status", "Status"]

#: the longest silence while the benchmark works (s)
EVERY = 10.0


class Status:
    """The benchmark's progress lines (see the module); ``begin`` once MPI is up."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.phase = "starting"
        self.last = 0.0                  # when a line was last written
        self.speaks = False              # rank 0 only
        self.lock = threading.Lock()
        self.ticker: Optional[threading.Thread] = None

    def begin(self, rank: int) -> None:
        """Start speaking (rank 0) and the thread that keeps a line coming."""
        self.speaks = rank == 0
        if self.speaks and self.ticker is None:
            self.ticker = threading.Thread(target=self._tick, daemon=True,
                                           name="mpigrad-bench progress")
            self.ticker.start()

    def say(self, phase: str) -> None:
        """A new phase (or a step of one): written at once."""
        with self.lock:
            self.phase = phase
            self._write()

    def end(self) -> None:
        """The work is done: no more lines."""
        with self.lock:
            self.speaks = False

    def _write(self) -> None:
        if self.speaks:
            now = time.monotonic()
            sys.stderr.write(f"mpigrad-bench: {self.phase} ({now - self.start:.0f} s)\n")
            sys.stderr.flush()
            self.last = now

    def _tick(self) -> None:
        while True:
            time.sleep(1.0)
            with self.lock:
                if not self.speaks:
                    return
                if time.monotonic() - self.last >= EVERY:
                    self._write()


#: the benchmark's one Status
status = Status()

"""Exception types of mpigrad (stdlib only)."""

from typing import Iterable

__all__ = ["MpigradError", "StructureMismatchError", "PeerError", "DivergenceError", "RanksLost",
           "TimedOut", "LaunchError"]


class MpigradError(Exception):
    """Base class of the errors mpigrad raises on its own account."""


class StructureMismatchError(MpigradError, ValueError):
    """Ranks disagree on the gradient list or on the reducer's settings."""


class PeerError(MpigradError):
    """Another rank failed its local checks, ended its program or freed its
    Reducer; this rank raises so that nobody hangs.

    Attributes:
        ranks: the ranks whose validation failed.
        messages: their error messages, in the order of ``ranks``.
    """

    def __init__(self, ranks: Iterable[int], messages: Iterable[str],
                 summary: str = "the call failed on") -> None:
        self.ranks = tuple(ranks)
        self.messages = tuple(messages)
        detail = "; ".join(f"rank {r}: {m}" for r, m in zip(self.ranks, self.messages))
        super().__init__(f"{summary} rank(s) {list(self.ranks)}: {detail}")


class DivergenceError(MpigradError):
    """Reduced results differ across ranks (found by ``Reducer(verify=True)``)."""


class RanksLost(MpigradError):
    """Ranks were lost (their processes failed) and the Reducer carried on
    without them (``on_failure="shrink"``): the call in progress did not
    complete, the caller's arrays are unchanged, and the Reducer is ready on
    the survivors' communicator.

    Attributes:
        failed: the lost ranks, as ranks of the communicator before the shrink.
        size: the number of ranks left.
    """

    def __init__(self, failed: Iterable[int], size: int) -> None:
        self.failed = tuple(failed)
        self.size = size
        super().__init__(f"rank(s) {list(self.failed)} lost; the Reducer carries on with "
                         f"{size} rank(s) (restore the last committed state and go on)")


class TimedOut(MpigradError, TimeoutError):
    """A collective of a group made to raise on a stall (the torch backend's,
    as gloo's do) did not complete within its timeout. Its messages cannot be
    taken back: the group is unusable from then on (every later call raises
    this), and the buffers of the stalled call are kept; destroy the group."""


class LaunchError(MpigradError, RuntimeError):
    """The launch cannot be what was meant: MPI's world has 1 rank while a
    launcher (torchrun, a plain srun, another MPI library's mpiexec) started
    several processes, each of which would train alone; the message names
    the launcher and the command that works (``MPIGRAD_ALONE=1`` allows it)."""

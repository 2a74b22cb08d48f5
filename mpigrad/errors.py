"""Exception types of mpigrad (stdlib only)."""

__all__ = ["MpigradError", "StructureMismatchError", "PeerError", "DivergenceError"]


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

    def __init__(self, ranks, messages, summary="reduce failed on"):
        self.ranks = tuple(ranks)
        self.messages = tuple(messages)
        detail = "; ".join(f"rank {r}: {m}" for r, m in zip(self.ranks, self.messages))
        super().__init__(f"{summary} rank(s) {list(self.ranks)}: {detail}")


class DivergenceError(MpigradError):
    """Reduced results differ across ranks (found by ``Reducer(verify=True)``)."""

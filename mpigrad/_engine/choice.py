"""Which backend sums a plan's blocking calls where several can: measured.

Which is faster, the cross-memory sum or the MPI library's own Allreduce (and,
for an in-place call that packs every bucket, node memory), depends on the
machine, its kernel, the library and the call (issue 52: the same ResNet-50
call won by cross-memory one day and by MPICH's shared-memory Allreduce
another). So a plan's first blocking calls of one kind take the
candidates in turn, ``TRIALS`` calls each; every rank times its calls, and at
the next call the ranks agree (one Allreduce of each candidate's slowest
rank's best time) on the candidate whose slowest rank was fastest, kept for
every later call of that plan and kind. Every rank counts the same calls, so
every rank takes the same backend in every call.
"""

from typing import Dict, List, Optional, Sequence

import numpy as np

from .._backends import SumBackend
from .._comm.communicator import Communicator

__all__ = ["Trial", "TRIALS"]

#: calls per candidate before the choice (the first of each warms it up, the
#: others timed: the best of 3 on each rank, a busy core's one slow call aside)
TRIALS = 4


class Trial:
    """The measured choice among ``candidates`` for one plan's calls of one kind."""

    def __init__(self, candidates: Sequence[SumBackend]) -> None:
        self.candidates = tuple(candidates)
        self.calls = 0
        self.best: List[float] = [np.inf] * len(self.candidates)   # this rank's, in seconds
        self.chosen: Optional[SumBackend] = None
        #: {candidate's name: its agreed time in ms}, once chosen
        self.measured: Dict[str, float] = {}

    def pick(self, comm: Communicator) -> SumBackend:
        """The backend of this call (collective on the call that decides)."""
        if self.chosen is None and self.calls == TRIALS * len(self.candidates):
            self._decide(comm)
        if self.chosen is not None:
            return self.chosen
        backend = self.candidates[self.calls % len(self.candidates)]
        self.calls += 1
        return backend

    def record(self, backend: SumBackend, seconds: float) -> None:
        """A call summed by ``backend`` took ``seconds`` on this rank (its first
        call is a warm-up: only later ones count)."""
        if self.chosen is None and self.calls > len(self.candidates):
            k = self.candidates.index(backend)
            self.best[k] = min(self.best[k], seconds)

    def _decide(self, comm: Communicator) -> None:
        # in µs; a rank without a time (its calls raised) adds none (-1): the
        # others' count, and a candidate no rank timed is taken last
        mine = np.array([-1 if t == np.inf else round(t * 1e6) for t in self.best], np.int64)
        comm.allreduce(mine, "max", "the agreement on the faster sum")
        timed = np.where(mine < 0, np.iinfo(np.int64).max, mine)
        self.chosen = self.candidates[int(np.argmin(timed))]
        self.measured = {c.name: int(t) / 1e3 for c, t in zip(self.candidates, mine) if t >= 0}

"""What this process's mpigrad calls cost in MPI operations, counted where
they start (Communicator.start, the agreement of checked.py): the figures
``mpigrad.statistics()`` reads, and that tests compare across faces."""

from dataclasses import dataclass

__all__ = ["Statistics", "TALLY", "statistics"]


@dataclass(frozen=True)
class Statistics:
    """Counts since the process started; the difference of two is what the
    calls between them cost.

    Args:
        calls: mpigrad calls begun (a reduce, a broadcast, a torch collective, ...).
        agreements: checked agreements (one tiny Allreduce each, in ``operations``).
        operations: MPI operations started: collectives, point-to-point, splits.
        notices: notices sent to peers (not in ``operations``): goodbyes of a freed
            Reducer or an abandoned call, the departures at exit (a few per live
            Reducer, O(log p)), a stall's questions and answers.
        moved: bytes this rank moved to or from its peers: what its MPI
            operations send, by each operation's definition (an allreduce
            2 (p-1)/p of its buffer, a reduce-scatter or an allgather (p-1)/p
            of the whole, a broadcast (p-1)/p, an alltoall what goes to the
            others, a send its message), and what it read from or wrote into
            its peers' memory (cross-memory sums).
    """

    calls: int = 0
    agreements: int = 0
    operations: int = 0
    notices: int = 0
    moved: int = 0

    def __sub__(self, earlier: "Statistics") -> "Statistics":
        return Statistics(self.calls - earlier.calls, self.agreements - earlier.agreements,
                          self.operations - earlier.operations, self.notices - earlier.notices,
                          self.moved - earlier.moved)


class _Tally:
    """The process's running counts (one per process; mpigrad's calls run one
    thread per communicator at a time, and a lost count under a race between
    two communicators' threads is a statistic, not a result)."""

    def __init__(self) -> None:
        self.calls = 0
        self.agreements = 0
        self.operations = 0
        self.notices = 0
        self.moved = 0


TALLY = _Tally()


def statistics() -> Statistics:
    """The counts of this process's mpigrad calls so far (see Statistics)."""
    return Statistics(TALLY.calls, TALLY.agreements, TALLY.operations, TALLY.notices,
                      TALLY.moved)

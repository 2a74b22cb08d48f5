"""The measured choice of a backend (mpigrad._engine.choice.Trial), one rank
in this process, its peers' times given through the agreement's Allreduce."""

import numpy as np

from mpigrad._engine.choice import TRIALS, Trial


class Backend:
    def __init__(self, name):
        self.name = name


class Peers:
    """A communicator whose Allreduce(MAX) meets the peers' given times (µs)."""

    def __init__(self, *theirs):
        self.theirs = [np.array(t, np.int64) for t in theirs]
        self.calls = 0

    def allreduce(self, array, op, what):
        assert op == "max"
        self.calls += 1
        for t in self.theirs:
            np.maximum(array, t, out=array)


def run(trial, comm, seconds, calls):
    taken = []
    for _ in range(calls):
        backend = trial.pick(comm)
        taken.append(backend.name)
        if seconds.get(backend.name) is not None:
            trial.record(backend, seconds[backend.name])
    return taken


def test_candidates_in_turn_then_the_one_whose_slowest_rank_was_fastest():
    cross, mpi = Backend("cross-memory"), Backend("mpi")
    trial = Trial((cross, mpi))
    # this rank: cross 10 ms, mpi 12 ms; a peer: cross 20 ms, mpi 13 ms -> mpi
    comm = Peers([20_000, 13_000])
    taken = run(trial, comm, {"cross-memory": 0.010, "mpi": 0.012}, 2 * TRIALS + 3)
    assert taken == ["cross-memory", "mpi"] * TRIALS + ["mpi"] * 3
    assert comm.calls == 1 and trial.measured == {"cross-memory": 20.0, "mpi": 13.0}


def test_the_warm_up_calls_do_not_count():
    cross, mpi = Backend("cross-memory"), Backend("mpi")
    trial = Trial((cross, mpi))
    for k in range(2 * TRIALS):
        backend = trial.pick(Peers())
        # each candidate's first call is slow (a warm-up); only cross is slow after
        slow = k < 2 or backend is cross
        trial.record(backend, 1.0 if slow else 0.001)
    assert trial.pick(Peers()) is mpi and trial.measured == {"cross-memory": 1000.0, "mpi": 1.0}


def test_a_candidate_no_rank_timed_is_taken_last():
    cross, mpi = Backend("cross-memory"), Backend("mpi")
    trial = Trial((cross, mpi))
    # cross's calls raised everywhere (never recorded); mpi timed by this rank only
    run(trial, Peers([-1, -1]), {"cross-memory": None, "mpi": 0.5}, 2 * TRIALS)
    assert trial.pick(Peers([-1, -1])) is mpi and trial.measured == {"mpi": 500.0}

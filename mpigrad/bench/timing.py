"""Interleaved timing across ranks: every repeat runs every case once, in turn."""

import random
import statistics
import time

__all__ = ["time_interleaved", "Timing"]


class Timing:
    """Per-repeat times of one case (the max over ranks of each repeat)."""

    def __init__(self, name):
        self.name = name
        self.times = []

    @property
    def min(self):
        return min(self.times)

    @property
    def median(self):
        return statistics.median(self.times)


def _time_once(comm, fn):
    from mpi4py import MPI
    comm.Barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX)


def time_interleaved(comm, cases, repeats, warmup=1):
    """Time ``cases`` (name -> callable) ``repeats`` times, in a shuffled order.

    Returns {name: Timing}. Each case runs ``warmup`` untimed times first.
    """
    names = list(cases)
    for name in names:
        for _ in range(warmup):
            cases[name]()
    timings = {name: Timing(name) for name in names}
    order = random.Random(0)      # the same order on every rank
    for _ in range(repeats):
        # a new order every repeat: no case always follows the same neighbour
        # (one that allocates or evicts the cache would bias it)
        for name in order.sample(names, len(names)):
            timings[name].times.append(_time_once(comm, cases[name]))
    return timings

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


def _time_once(comm, fn, prepare=None):
    from mpi4py import MPI
    if prepare is not None:
        prepare()
    comm.Barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX)


def time_interleaved(comm, cases, repeats, warmup=1, prepare=None):
    """Time ``cases`` (name -> callable) ``repeats`` times, in a shuffled order.

    Returns {name: Timing}. Each case runs ``warmup`` untimed times first.
    ``prepare`` (name -> callable) runs untimed before each timed call of
    that case: it writes the case's inputs afresh, as backward writes the
    gradients before a reduce (memory written just before a collective and
    memory left alone for a while reduce at very different speeds here).
    """
    prepare = prepare or {}
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
            timings[name].times.append(_time_once(comm, cases[name], prepare.get(name)))
    return timings

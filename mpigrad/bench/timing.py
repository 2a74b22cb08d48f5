"""Interleaved timing across ranks: every repeat runs every case once, in turn."""

import random
import statistics
import time

from .progress import status

__all__ = ["time_interleaved", "Progress", "Timing", "ratio_range", "within_noise", "looks_loaded"]


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

    @property
    def spread(self):
        """Median over min: 1.0 on a quiet machine, well above it under load."""
        return self.median / self.min


def ratio_range(num, den):
    """(lowest, highest) of ``num``'s time over ``den``'s, repeat by repeat
    (the two ran in the same repeat, interleaved, so each pair saw the same
    load)."""
    pairs = [a / b for a, b in zip(num.times, den.times) if b > 0]
    return (min(pairs), max(pairs)) if pairs else (float("nan"), float("nan"))


def within_noise(a, b):
    """Whether two cases' min-to-median intervals overlap: their difference
    is not established by this run."""
    return a.min <= b.median and b.min <= a.median


#: a run whose cases' median is this far above their min (the median over
#: cases) ran on a loaded or noisy machine
LOADED_SPREAD = 1.25


def looks_loaded(timings):
    """The median over cases of median/min when at or above LOADED_SPREAD,
    else None."""
    spreads = [t.spread for t in timings if len(t.times) > 1]
    if not spreads:
        return None
    typical = statistics.median(spreads)
    return typical if typical >= LOADED_SPREAD else None


class Progress:
    """A phase's steps as the benchmark's progress lines (progress.status)."""

    def __init__(self, comm, total, label):
        self.total, self.label, self.done = total, label, 0
        status.say(f"{label}: warming up")

    def step(self, what):
        self.done += 1
        status.say(f"{self.label}: {self.done}/{self.total} ({what})")

    def close(self):
        pass


def _time_once(comm, fn, prepare=None):
    from mpi4py import MPI
    if prepare is not None:
        prepare()
    comm.Barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX)


def time_interleaved(comm, cases, repeats, warmup=1, prepare=None, label=None):
    """Time ``cases`` (name -> callable) ``repeats`` times, in a shuffled order.

    Returns {name: Timing}. Each case runs ``warmup`` untimed times first.
    ``prepare`` (name -> callable) runs untimed before each timed call of
    that case: it writes the case's inputs afresh, as backward writes the
    gradients before a reduce (memory written just before a collective and
    memory left alone for a while reduce at very different speeds here).
    With ``label``, a progress line on stderr once it runs longer than 3 s.
    """
    prepare = prepare or {}
    names = list(cases)
    progress = Progress(comm, repeats + 1, label) if label else None
    for name in names:
        for _ in range(warmup):
            cases[name]()
    if progress:
        progress.step("warm-up")
    timings = {name: Timing(name) for name in names}
    order = random.Random(0)      # the same order on every rank
    for repeat in range(repeats):
        # a new order every repeat: no case always follows the same neighbour
        # (one that allocates or evicts the cache would bias it)
        for name in order.sample(names, len(names)):
            timings[name].times.append(_time_once(comm, cases[name], prepare.get(name)))
        if progress:
            progress.step(f"repeat {repeat + 1} of {repeats}, {len(names)} cases")
    if progress:
        progress.close()
    return timings

"""Checking what the benchmark timed: every mpigrad case is run once more on
per-position values and its results compared with a numpy reference computed
independently of mpigrad, so that a misplaced slot or a wrong scale fails."""

import numpy as np
from mpi4py import MPI

from .._base.dtypes import wire_dtype

__all__ = ["fill", "expected", "verify_cases"]

_PERIOD = 13      # values (j*7 + 3i + rank) % 13 - 6: exact in every dtype, sums too


def _values(index, size, rank):
    return (np.arange(size, dtype=np.int64) * 7 + 3 * index + rank) % _PERIOD - 6


def fill(arrays, rank):
    """Write gradient ``i``'s per-position values for ``rank`` into ``arrays[i]``."""
    for index, array in enumerate(arrays):
        array[...] = _values(index, array.size, rank).reshape(array.shape)


def expected(shapes, dtype, size, mean, exact=False):
    """The reduced values of ``fill`` over ``size`` ranks, as mpigrad defines
    them: the sum in the wire dtype, times 1/size there with ``mean``, one
    cast back; ``exact`` (reproducible=True): the exact sum divided by size,
    rounded once."""
    wire = wire_dtype(dtype)
    out = []
    for index, shape in enumerate(shapes):
        n = int(np.prod(shape))
        total = sum(_values(index, n, r) for r in range(size)).astype(wire)
        if mean and size > 1 and exact:     # small integers: the float64 quotient rounds once
            total = total.astype(np.float64) / size
        elif mean and size > 1:
            total = total * wire.type(1.0 / size)
        out.append(total.astype(dtype).reshape(shape))
    return out


def verify_cases(comm, cases, refill, want):
    """Names of the ``cases`` (name -> callable returning its results) whose
    results differ from ``want`` on any rank; ``refill()`` resets their inputs
    before each one runs."""
    failed = []
    for name, case in cases.items():
        refill()
        results = case()
        ok = len(results) == len(want) and all(
            np.asarray(r).dtype == w.dtype and np.array_equal(np.asarray(r), w)
            for r, w in zip(results, want))
        if not comm.allreduce(ok, op=MPI.LAND):
            failed.append(name)
    return failed

"""Data-parallel linear regression in numpy with mpigrad, checked against
training on one rank.

    mpiexec -n 2 python -m mpi4py examples/numpy_sgd.py

Every rank holds a different shard of one noisy data set (rank r: rows
r, r+p, ...), so each rank's own gradient differs from the full-batch one. With
gradients averaged across ranks, N ranks with per-rank batch b take exactly
the steps of 1 rank with batch N*b (up to float64 rounding), and the example
checks that after STEPS steps, before convergence, against that 1-rank run
computed here. A reduction that did nothing, summed instead of averaging, or
put a value in the wrong slot moves the weights by far more than TOLERANCE, and
the example exits non-zero.
"""

import sys

import numpy as np
from mpi4py import MPI

import mpigrad

STEPS, LR, ROWS_PER_RANK, FEATURES, OUTPUTS = 30, 0.1, 96, 6, 2
TOLERANCE = 1e-9          # relative to the weights' size; float64 rounding is ~1e-14


def data(size):
    """The whole data set: X (rows, FEATURES), Y (rows, OUTPUTS), noisy."""
    rng = np.random.default_rng(1234)
    rows = ROWS_PER_RANK * size
    x = rng.standard_normal((rows, FEATURES))
    true_w = rng.standard_normal((FEATURES, OUTPUTS))
    y = x @ true_w + 0.5 + 0.3 * rng.standard_normal((rows, OUTPUTS))
    return x, y


def gradients(params, x, y):
    w, b = params
    err = x @ w + b - y
    return [x.T @ err / len(x), err.mean(axis=0)]


def train(params, x, y, reduce):
    for _ in range(STEPS):
        grads = reduce(gradients(params, x, y))
        for p, g in zip(params, grads):
            p -= LR * g
    return params


def initial_params(rank):
    rng = np.random.default_rng(rank)             # different on every rank ...
    return [rng.standard_normal((FEATURES, OUTPUTS)), rng.standard_normal(OUTPUTS)]


def main():
    comm = MPI.COMM_WORLD
    x, y = data(comm.size)
    params = mpigrad.broadcast(initial_params(comm.rank), root=0)   # ... until broadcast
    reference = train([p.copy() for p in initial_params(0)], x, y, lambda g: g)
    shard = slice(comm.rank, None, comm.size)
    with mpigrad.Reducer() as reducer:           # mean over ranks
        params = train(params, x[shard], y[shard],
                       lambda g: reducer.reduce(g, inplace=True))
    scale = max(float(np.abs(r).max()) for r in reference)
    deviation = max(float(np.abs(p - r).max()) for p, r in zip(params, reference)) / scale
    identical = comm.allreduce(
        [p.tobytes() for p in params] == comm.bcast([p.tobytes() for p in params]), MPI.LAND)
    ok = deviation <= TOLERANCE and identical
    if comm.rank == 0:
        print(f"{comm.size} ranks x {ROWS_PER_RANK} rows against 1 rank x "
              f"{comm.size * ROWS_PER_RANK} rows, {STEPS} steps: relative deviation "
              f"{deviation:.2e} (tolerance {TOLERANCE:g}); identical on all ranks: {identical}")
        print("equivalent to 1-rank full-batch training:", ok)
    return 0 if comm.allreduce(ok, MPI.LAND) else 1


if __name__ == "__main__":
    sys.exit(main())

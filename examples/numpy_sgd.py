"""Data-parallel linear regression in numpy with mpigrad.

    mpiexec -n 2 python -m mpi4py examples/numpy_sgd.py
"""

import numpy as np
from mpi4py import MPI

import mpigrad


def main(steps=200, lr=0.1):
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    true_w = np.arange(1.0, 9.0, dtype=np.float32).reshape(4, 2)
    params = [rng.standard_normal((4, 2)).astype(np.float32), np.zeros(2, np.float32)]
    mpigrad.broadcast(params, root=0)                # every rank starts alike
    with mpigrad.Reducer() as reducer:               # mean over ranks
        for _ in range(steps):
            x = rng.standard_normal((64, 4)).astype(np.float32)   # this rank's shard
            err = x @ params[0] + params[1] - (x @ true_w + 0.5)
            grads = [x.T @ err / len(x), err.mean(axis=0)]
            reducer.reduce(grads, inplace=True)
            for p, g in zip(params, grads):
                p -= lr * g
    if comm.rank == 0:
        print("max weight error", float(np.abs(params[0] - true_w).max()),
              "bias", params[1])


if __name__ == "__main__":
    main()

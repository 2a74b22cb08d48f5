"""A jax model with a dict of parameters, trained with jax.grad and mpigrad
outside jit: the gradients' pytree is reduced as it is, and the loss is
averaged with mpigrad.allreduce for logging.

    mpiexec -n 2 python examples/jax_regression.py

This is the form for code that keeps the reduction out of its compiled
pieces; inside jax.jit, mpigrad.jax.reduce (or mean_gradients in an optax
chain) does it: examples/jax_flax_jit.py. The example checks that N ranks with per-rank batch b take the
same steps as 1 rank with batch N*b, and exits non-zero otherwise.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpigrad

STEPS, BATCH_PER_RANK, LR = 40, 32, 0.05
TOLERANCE = 1e-5          # float32 sums in another order


def loss_fn(params, x, y):
    hidden = jnp.tanh(x @ params["dense"]["w"] + params["dense"]["b"])
    return jnp.mean((hidden @ params["out"] - y) ** 2)


grad_fn = jax.jit(jax.value_and_grad(loss_fn))


def init():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"dense": {"w": jax.random.normal(k1, (4, 16)) * 0.5, "b": jnp.zeros(16)},
            "out": jax.random.normal(k2, (16, 1)) * 0.5}


def data(size):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((STEPS, BATCH_PER_RANK * size, 4)).astype(np.float32)
    y = (np.sin(x).sum(axis=2, keepdims=True) + 0.1 * rng.standard_normal(
        (STEPS, BATCH_PER_RANK * size, 1))).astype(np.float32)
    return x, y


def train(x, y, rank, size, reduce):
    params = init()
    loss = None
    for step in range(STEPS):
        loss, grads = grad_fn(params, x[step, rank::size], y[step, rank::size])
        grads = reduce(grads)                     # the pytree, reduced outside jit
        params = jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)
    return params, loss


def main():
    comm = MPI.COMM_WORLD
    x, y = data(comm.size)
    with mpigrad.Reducer() as reducer:
        params, loss = train(x, y, comm.rank, comm.size, reducer.reduce)
    mean_loss = mpigrad.allreduce(float(loss))
    reference, _ = train(x, y, 0, 1, lambda g: g)
    deviation = max(float(jnp.abs(a - b).max()) for a, b in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(reference)))
    ok = comm.allreduce(deviation <= TOLERANCE, MPI.LAND)
    if comm.rank == 0:
        print(f"{comm.size} ranks x batch {BATCH_PER_RANK} against 1 rank x batch "
              f"{comm.size * BATCH_PER_RANK}: max deviation {deviation:.1e} (tolerance "
              f"{TOLERANCE:g}); last loss averaged over ranks {mean_loss:.4f}")
        print("claims hold:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

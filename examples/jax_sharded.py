"""Sharded Adam (ZeRO-2) on jax with optax: each rank keeps the Adam state of
its shard of the parameters only, and trains as one rank with the whole batch.

    mpiexec -n 2 python examples/jax_sharded.py

mpigrad.shard.Sharded reduce-scatters the gradients (the mean gradient is
never made whole), runs optax on this rank's shard, and gathers the updated
parameters. The example prints the Adam state bytes per rank against an
unsharded optax state and the largest deviation from 1-rank full-batch
training, and exits non-zero if the state is not 1/p of it (give or take a
few elements) or the deviation is beyond float32 rounding.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import mpigrad
from mpigrad.shard import Sharded

STEPS, BATCH_PER_RANK, LR = 30, 32, 0.01
TOLERANCE = 1e-5          # float32 sums in another order


def loss_fn(params, x, y):
    hidden = jnp.tanh(x @ params["dense"]["w"] + params["dense"]["b"])
    return jnp.mean((hidden @ params["out"] - y) ** 2)


grad_fn = jax.jit(jax.grad(loss_fn))


def init():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"dense": {"w": jax.random.normal(k1, (8, 64)) * 0.3, "b": jnp.zeros(64)},
            "out": jax.random.normal(k2, (64, 1)) * 0.3}


def data(size):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((STEPS, BATCH_PER_RANK * size, 8)).astype(np.float32)
    y = np.sin(x).sum(axis=2, keepdims=True).astype(np.float32)
    return x, y


def state_bytes(state):
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state))


def main():
    comm = MPI.COMM_WORLD
    x, y = data(comm.size)
    tx = optax.adam(LR)
    with mpigrad.Reducer() as reducer:
        params = init()
        step = Sharded(params, tx, reducer=reducer)
        for k in range(STEPS):
            params = step(grad_fn(params, x[k, comm.rank::comm.size], y[k, comm.rank::comm.size]))
        sharded_bytes = step.state_bytes()
    reference, state = init(), tx.init(init())          # 1 rank, whole batch, unsharded
    for k in range(STEPS):
        updates, state = tx.update(grad_fn(reference, x[k], y[k]), state, reference)
        reference = optax.apply_updates(reference, updates)
    deviation = max(float(jnp.abs(a - b).max()) for a, b in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(reference)))
    full_bytes = state_bytes(state)
    state_ok = sharded_bytes <= full_bytes / comm.size + 64
    ok = comm.allreduce(deviation <= TOLERANCE and state_ok, MPI.LAND)
    if comm.rank == 0:
        print(f"Adam state per rank: {sharded_bytes} bytes sharded against {full_bytes} "
              f"unsharded ({sharded_bytes / full_bytes:.3f}; 1/p = {1 / comm.size:.3f})")
        print(f"{comm.size} ranks x batch {BATCH_PER_RANK} against 1 rank x batch "
              f"{BATCH_PER_RANK * comm.size}: largest parameter deviation {deviation:.2e} "
              f"(tolerance {TOLERANCE:g})")
        print(f"claims hold: {ok}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

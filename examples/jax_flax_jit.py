"""A flax model trained with optax, the whole data-parallel step one
``jax.jit``: the gradients are averaged over the ranks inside the compiled
step by ``mpigrad.jax.mean_gradients()`` (first in the optax chain), and the
loss by ``mpigrad.jax.allreduce``.

    mpiexec -n 2 python examples/jax_flax_jit.py

The example checks that N ranks with per-rank batch b take the same steps as
1 rank with batch N*b (within float32 rounding), with the same bits on every
rank, and exits non-zero otherwise.
"""

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import mpigrad.jax

STEPS, BATCH_PER_RANK = 30, 32
TOLERANCE = 1e-4          # adam's steps of float32 sums in another order


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(32)(x)))


model = MLP()


def loss_fn(params, x, y):
    return jnp.mean((model.apply(params, x) - y) ** 2)


def data(size):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((STEPS, BATCH_PER_RANK * size, 4)).astype(np.float32)
    y = (np.sin(x).sum(axis=2, keepdims=True) + 0.1 * rng.standard_normal(
        (STEPS, BATCH_PER_RANK * size, 1))).astype(np.float32)
    return x, y


def train(tx, x, y, average_loss):
    @jax.jit
    def step(params, state, xb, yb):           # the whole step: one compiled function
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, average_loss(loss)

    params = model.init(jax.random.PRNGKey(0), x[0, :1])
    state, loss = tx.init(params), None
    for k in range(len(x)):
        params, state, loss = step(params, state, x[k], y[k])
    return params, loss


def main():
    comm = MPI.COMM_WORLD
    x, y = data(comm.size)
    mine = slice(comm.rank * BATCH_PER_RANK, (comm.rank + 1) * BATCH_PER_RANK)
    params, loss = train(optax.chain(mpigrad.jax.mean_gradients(), optax.adam(1e-2)),
                         x[:, mine], y[:, mine], mpigrad.jax.allreduce)
    reference, _ = train(optax.adam(1e-2), x, y, lambda v: v)
    deviation = max(float(jnp.abs(a - b).max()) for a, b in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(reference)))
    bits = b"".join(np.asarray(p).tobytes() for p in jax.tree_util.tree_leaves(params))
    same = all(other == bits for other in comm.allgather(bits))
    ok = comm.allreduce(deviation <= TOLERANCE, MPI.LAND) and same
    if comm.rank == 0:
        print(f"{comm.size} ranks x batch {BATCH_PER_RANK} against 1 rank x batch "
              f"{comm.size * BATCH_PER_RANK}, each step one jax.jit: max deviation "
              f"{deviation:.1e} (tolerance {TOLERANCE:g}); the same bits on every rank: "
              f"{same}; last loss averaged over ranks {float(loss):.4f}")
        print("claims hold:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

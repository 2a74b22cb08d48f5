"""jax integration: gradients reduced inside ``jax.jit``, so that the whole
data-parallel step (loss, ``jax.grad``, the optax update) is one compiled
function.

Imported only by users who ``import mpigrad.jax``; jax (and optax, for
``mean_gradients``) stays optional.

    import optax, mpigrad.jax
    tx = optax.chain(mpigrad.jax.mean_gradients(), optax.adam(1e-3))

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)   # grads: the mean over ranks
        return optax.apply_updates(params, updates), state, mpigrad.jax.allreduce(loss)

Each reduction is one host call on XLA's own buffers (zero-copy on the CPU),
running the Reducer's own reduction; the calls of one step run in the order
they were traced on every rank, by construction (jax's ordered effects:
mpigrad.jax.host_call).
"""

from .gradient_transform import mean_gradients
from .host_call import zero_copy
from .reductions import allreduce, default_reducer, reduce

__all__ = ["reduce", "allreduce", "mean_gradients", "default_reducer", "zero_copy"]

"""``mean_gradients``: the reduction of gradients as an optax transformation."""

from typing import Any, Optional

from ..reducer import Reducer
from .reductions import reduce

__all__ = ["mean_gradients"]


def mean_gradients(reducer: Optional[Reducer] = None) -> Any:
    """An optax ``GradientTransformation`` whose update is ``reduce(updates,
    reducer)`` (default: the mean over COMM_WORLD), first in a chain:
    ``optax.chain(mpigrad.jax.mean_gradients(), optax.adam(1e-3))``. Works
    inside ``jax.jit``; it keeps no state."""
    import optax

    def init(params: Any) -> Any:
        del params
        return optax.EmptyState()

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        del params
        return reduce(updates, reducer), state

    return optax.GradientTransformation(init, update)

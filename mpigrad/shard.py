"""A framework-neutral sharded optimizer step (ZeRO-2 on MPI).

Each rank keeps the optimizer state, and a master copy of the parameters in
the wire dtype, for its shard of the fused parameter space only
(``Reducer.shards``); a step is a reduce-scatter of the gradients (the full
mean gradient is never made), the update of the shard, and an allgather of
the updated shards into the full parameters:

    step = mpigrad.shard.Sharded(params, optax.adam(1e-3))      # jax + optax
    params = step(grads)

    def sgd(params, grads, state):       # numpy: {wire dtype: flat shard}
        for dtype in params:
            params[dtype] -= 0.1 * grads[dtype]
        return state
    step = mpigrad.shard.Sharded(params, sgd)                   # numpy arrays
    step(grads)                                                 # params updated in place

The update sees (and the state holds) 1/p of the elements: state bytes per
rank are 1/p of an unsharded optimizer's. An elementwise update (SGD,
momentum, Adam, ...) gives the unsharded run's parameters, bitwise where the
mean gradients are.
"""

from typing import Any, Callable, Dict, Optional

import numpy as np

from ._engine.arrays import from_host, to_host
from ._engine.tree import flatten, unflatten
from .reducer import Reducer

__all__ = ["Sharded"]

Shards = Dict[np.dtype, np.ndarray]


class Sharded:
    """A sharded optimizer step over ``params`` (collective: every rank
    builds it with the same parameters, broadcast first).

    Args:
        params: the parameters, any pytree of arrays (numpy arrays are updated
            in place; jax arrays, immutable, come back new from each step).
        update: an optax ``GradientTransformation``, or a function
            ``update(params, grads, state) -> state`` of numpy shards: it
            updates ``params`` ({wire dtype: this rank's flat shard}) in
            place from ``grads`` (the same layout: this rank's shard of the
            mean gradient).
        init: with a numpy ``update``, ``init(params) -> state`` (default:
            no state).
        reducer: the Reducer to use (default: a new one, made with
            ``reducer_options``, freed by ``free``).
    """

    def __init__(self, params: Any, update: Any, init: Optional[Callable[[Shards], Any]] = None,
                 reducer: Optional[Reducer] = None, **reducer_options: Any) -> None:
        self.reducer = Reducer(**reducer_options) if reducer is None else reducer
        self._owns_reducer = reducer is None
        self.params = params
        self.update = update
        self.optax = hasattr(update, "init") and hasattr(update, "update")
        self.master = self._shard_of(params)         # this rank's, in the wire dtype
        if self.optax:
            self.state = update.init(self._jax(self.master))
        else:
            self.state = None if init is None else init(self.master)

    def _shard_of(self, params: Any) -> Shards:
        """This rank's elements of ``params``, per wire dtype, as new arrays."""
        leaves, _ = flatten(params)
        host, _ = to_host(leaves, inplace=False)
        return {dtype: np.concatenate([np.asarray(host[i]).reshape(-1)[a:b].astype(dtype)
                                       for i, a, b in ranges] or [np.empty(0, dtype)])
                for dtype, ranges in self.reducer.shards(params).items()}

    @staticmethod
    def _jax(shards: Shards) -> Dict[str, Any]:
        import jax.numpy as jnp
        return {dtype.name: jnp.asarray(shard) for dtype, shard in shards.items()}

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state (its arrays), beside the master shard."""
        leaves, _ = flatten(self.state)
        return sum(int(getattr(leaf, "nbytes", 0)) for leaf in leaves)

    def __call__(self, grads: Any) -> Any:
        """One step: reduce-scatter ``grads``, update this rank's shard,
        gather the parameters; return them (numpy: the same arrays, updated)."""
        shards = self.reducer.reduce_scatter(grads)
        if self.optax:
            import optax
            params = self._jax(self.master)
            updates, self.state = self.update.update(self._jax(shards), self.state, params)
            new = optax.apply_updates(params, updates)
            self.master = {dtype: np.array(new[dtype.name]) for dtype in self.master}
        else:
            self.state = self.update(self.master, shards, self.state)
        leaves, spec = flatten(self.params)
        host, kinds = to_host(leaves, inplace=False)
        if kinds is None:                # numpy: gathered into the caller's arrays
            return self.reducer.allgather_shards(self.master, into=self.params)
        copies = [np.array(h) for h in host]
        self.reducer.allgather_shards(self.master, into=copies)
        self.params = unflatten(spec, from_host(copies, leaves, host, kinds, inplace=False))
        return self.params

    step = __call__

    def free(self) -> None:
        """Free the Reducer this step made (not one it was given)."""
        if self._owns_reducer:
            self.reducer.free()

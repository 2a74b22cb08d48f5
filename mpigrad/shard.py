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

``state_dict()`` gathers the master parameters and every per-element part of
the state whole (laid out like the parameters), so that ``load_state_dict``
at any world size takes its own shard of it. Per-element parts are found as
optax lays them out: dicts keyed by the wire dtypes (their names, or numpy
dtypes) of 1-D arrays of the shard's sizes.
"""

from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ._base.arrays import from_host, to_host
from ._engine.shards import wire_dtypes
from ._base.tree import flatten, unflatten
from .reducer import Reducer

__all__ = ["Sharded", "gathered_whole"]

Shards = Dict[np.dtype, np.ndarray]

# the key of a gathered per-element part in state_dict()'s state
_WHOLE = "mpigrad whole"


def gathered_whole(reducer: Reducer, shards: Dict[Any, Any],
                   like: List[Any]) -> List[np.ndarray]:
    """Every rank's ``shards`` ({wire dtype or its name: this rank's shard})
    gathered into new arrays shaped like the host arrays ``like`` (the
    parameters), in their wire dtypes (collective over ``reducer``)."""
    by_dtype = {np.dtype(key): np.asarray(value) for key, value in shards.items()}
    wire = wire_dtypes(reducer.plan(like))
    whole = [np.zeros(np.shape(h), wire.get(i, np.asarray(h).dtype)) for i, h in enumerate(like)]
    reducer.allgather_shards(by_dtype, into=whole)
    return whole


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

    # -- checkpoints, independent of the world size -----------------------
    def _per_element(self, node: Any) -> bool:
        """Whether ``node`` is a per-element part of the state: {wire dtype
        (or its name): this rank's 1-D shard of it}."""
        if not isinstance(node, dict) or len(node) != len(self.master):
            return False
        sizes = {dtype.name: shard.size for dtype, shard in self.master.items()}
        names = [key.name if isinstance(key, np.dtype) else key for key in node]
        return all(isinstance(name, str) and name in sizes and np.shape(value) == (sizes[name],)
                   for name, value in zip(names, node.values()))

    def _gathered(self, shards: Dict[Any, Any]) -> Any:
        """Every rank's ``shards`` ({wire dtype or name: shard}) gathered into
        arrays shaped like the parameters, in the wire dtypes (collective)."""
        leaves, spec = flatten(self.params)
        host, _ = to_host(leaves, inplace=False)
        return unflatten(spec, gathered_whole(self.reducer, shards, host))

    def state_dict(self) -> Dict[str, Any]:
        """{"params": the master parameters, "state": the optimizer state},
        every per-element part gathered whole, laid out like the parameters
        (collective: every rank gets it; save it on one). Loads into a Sharded
        at any world size (``load_state_dict``)."""
        def whole(node: Any) -> Any:
            if self._per_element(node):
                keys = "names" if all(isinstance(k, str) for k in node) else "dtypes"
                return {_WHOLE: self._gathered(node), "keys": keys}
            return _map_children(node, whole)
        return {"params": self._gathered(self.master), "state": whole(self.state)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take this rank's shard of ``state_dict`` (from ``state_dict()`` at
        any world size): the master parameters and the optimizer state; the
        parameters themselves are the caller's to restore."""
        def shard(node: Any) -> Any:
            if isinstance(node, dict) and _WHOLE in node:
                mine = self._shard_of(node[_WHOLE])
                if self.optax:
                    return self._jax(mine)
                return mine if node["keys"] == "dtypes" else {d.name: a for d, a in mine.items()}
            return _map_children(node, shard)
        self.master = self._shard_of(state_dict["params"])
        self.state = shard(state_dict["state"])

    def free(self) -> None:
        """Free the Reducer this step made (not one it was given)."""
        if self._owns_reducer:
            self.reducer.free()


def _map_children(node: Any, fn: Callable[[Any], Any]) -> Any:
    """``node`` with ``fn`` applied to each child of a dict, list or tuple
    (namedtuples, optax's states, rebuilt as such); other nodes as they are."""
    if isinstance(node, dict):
        return {key: fn(value) for key, value in node.items()}
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*map(fn, node))
    if isinstance(node, (list, tuple)):
        return type(node)(map(fn, node))
    return node

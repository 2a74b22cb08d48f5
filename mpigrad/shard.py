"""A sharded optimizer step (ZeRO-2 on MPI): the one ZeRO core, framework-neutral.

Each rank keeps the optimizer state, and the values it steps, for its shard
of the fused parameter space only (``Reducer.shards``): its pieces, one per
parameter range it owns. A step is a reduce-scatter of the gradients (the
full mean gradient is never made), the update of the shard, and an
allgather of the updated shards into the full parameters:

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
mean gradients are. torch's ShardedOptimizer runs on this core through a
per-parameter adapter (``update=None``, ``in_place=True``: the torch
optimizer steps the pieces, parameters of the wire dtype in their own memory).

``state_dict()`` gathers the master parameters and every per-element part of
the state whole (laid out like the parameters), so that ``load_state_dict``
at any world size takes its own shard of it. Per-element parts are found as
optax lays them out: dicts keyed by the wire dtypes (their names, or numpy
dtypes) of 1-D arrays of the shard's sizes.
"""

from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ._base.arrays import from_host, to_host
from ._base.dtypes import assign
from ._base.tree import flatten, unflatten
from ._engine.shards import wire_dtypes
from .reducer import PendingShards, Reducer

__all__ = ["Sharded", "Piece", "gathered_whole"]

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


class Piece:
    """One parameter range this rank owns: parameter ``index``'s flat
    elements [first, stop), stepped as ``values``: a 1-D view of the
    parameter itself, or (``copy``) of this rank's master copy in the wire
    dtype, kept from step to step."""

    __slots__ = ("index", "first", "stop", "values", "copy")

    def __init__(self, index: int, first: int, stop: int, values: np.ndarray,
                 copy: bool) -> None:
        self.index, self.first, self.stop = index, first, stop
        self.values, self.copy = values, copy

    @property
    def size(self) -> int:
        return self.stop - self.first

    def of(self, whole: Any) -> np.ndarray:
        """This piece's elements of ``whole``, an array shaped like its parameter."""
        return np.ravel(np.asarray(whole))[self.first:self.stop]


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
            mean gradient); or None, where the caller steps ``pieces``
            itself (an adapter: mpigrad.torch.ShardedOptimizer).
        init: with a numpy ``update``, ``init(params) -> state`` (default:
            no state).
        reducer: the Reducer to use (default: a new one, made with
            ``reducer_options``, freed by ``free``).
        in_place: step every piece of a parameter of its wire dtype and C
            order in the parameter's own memory (a master copy only for the
            others); default: every shard in one flat master per wire dtype.
    """

    def __init__(self, params: Any, update: Any = None,
                 init: Optional[Callable[[Shards], Any]] = None,
                 reducer: Optional[Reducer] = None, *, in_place: bool = False,
                 **reducer_options: Any) -> None:
        self.reducer = Reducer(**reducer_options) if reducer is None else reducer
        self._owns_reducer = reducer is None
        self.params = params
        self.update = update
        self.in_place = in_place
        self.optax = hasattr(update, "init") and hasattr(update, "update")
        self.place()
        if self.optax:
            self.state = update.init(self._jax(self.master))
        else:
            self.state = None if init is None else init(self.master)

    # -- the pieces ---------------------------------------------------------
    def place(self) -> None:
        """Cut this rank's pieces for the reducer's communicator as it is now
        (after a shrink, the survivors'), from the parameters' values."""
        comm = self.reducer.comm
        self.placed = (comm.Get_rank(), comm.Get_size())
        self.host = self._host(self.params)
        self.master: Shards = {}
        self.pieces: Dict[np.dtype, List[Piece]] = {}
        for dtype, ranges in self.reducer.shards(self.params).items():
            if self.in_place:
                self.pieces[dtype] = [self._piece(dtype, *r) for r in ranges]
                continue
            flat = np.concatenate([self.host[i].reshape(-1)[a:b].astype(dtype)
                                   for i, a, b in ranges] or [np.empty(0, dtype)])
            self.master[dtype] = flat
            self.pieces[dtype] = list(_slices(flat, ranges))

    def _piece(self, dtype: np.dtype, index: int, first: int, stop: int) -> Piece:
        """Stepped in the parameter itself where it is of the wire dtype, in
        C order and writeable."""
        array = self.host[index]
        if array.dtype == dtype and array.flags.c_contiguous and array.flags.writeable:
            return Piece(index, first, stop, array.reshape(-1)[first:stop], copy=False)
        return Piece(index, first, stop, np.ravel(array)[first:stop].astype(dtype), copy=True)

    def all_pieces(self) -> Iterator[Piece]:
        """Every piece, wire dtype by wire dtype, in shard order."""
        for pieces in self.pieces.values():
            yield from pieces

    def split(self, shards: Shards) -> Iterator[Tuple[Piece, np.ndarray]]:
        """(piece, its part of ``shards``): the shards ({wire dtype: this
        rank's flat shard}) cut at the pieces."""
        for dtype, pieces in self.pieces.items():
            yield from zip(pieces, _cut(shards[dtype], [p.size for p in pieces]))

    def joined(self, per_piece: Callable[[Piece], np.ndarray]) -> Shards:
        """{wire dtype: this rank's flat shard} made of ``per_piece(piece)``."""
        return {dtype: np.concatenate([np.asarray(per_piece(p), dtype).reshape(-1)
                                       for p in pieces] or [np.empty(0, dtype)])
                for dtype, pieces in self.pieces.items()}

    def gathered(self, shards: Dict[Any, Any]) -> List[np.ndarray]:
        """Every rank's ``shards`` gathered into arrays shaped like the
        parameters, in the wire dtypes (collective)."""
        return gathered_whole(self.reducer, shards, self.host)

    # -- the step -------------------------------------------------------------
    def scatter(self, grads: Any, agree: Optional[Dict[str, Any]] = None) -> Shards:
        """This rank's shard of the mean of ``grads`` (Reducer.reduce_scatter)."""
        return self.reducer.reduce_scatter(grads, agree=agree)

    def start_scatter(self, grads: Any, agree: Optional[Dict[str, Any]] = None) -> PendingShards:
        """``scatter`` overlapped with backward (Reducer.start_reduce_scatter)."""
        return self.reducer.start_reduce_scatter(grads, agree=agree)

    def refresh(self) -> None:
        """Take the parameters' values into the master copies of in-place
        pieces where they were changed since the last step (a load, a
        broadcast after wrapping): the parameters are the truth; a master
        keeps its extra bits otherwise."""
        for piece in self.all_pieces():
            if piece.copy and self.in_place:
                values = piece.of(self.host[piece.index])
                if not np.array_equal(piece.values.astype(values.dtype), values):
                    piece.values[...] = values

    def gather(self) -> Any:
        """The updated shards into every rank's parameters (collective);
        returns the parameters (jax: new arrays)."""
        if self.in_place:          # each rank's shard into its parameters, the others' gathered
            for piece in self.all_pieces():
                if piece.copy:
                    _set_elements(self.host[piece.index], piece.first, piece.stop,
                                  piece.values)
            return self.reducer.allgather_shards(None, into=self.params)
        leaves, spec = flatten(self.params)
        host, kinds = to_host(leaves, inplace=False)
        if kinds is None:                # numpy: gathered into the caller's arrays
            return self.reducer.allgather_shards(self.master, into=self.params)
        copies = [np.array(h) for h in host]
        self.reducer.allgather_shards(self.master, into=copies)
        self.params = unflatten(spec, from_host(copies, leaves, host, kinds, inplace=False))
        self.host = self._host(self.params)
        return self.params

    def __call__(self, grads: Any) -> Any:
        """One step: reduce-scatter ``grads``, update this rank's shard,
        gather the parameters; return them (numpy: the same arrays, updated)."""
        if self.update is None:
            raise TypeError("Sharded(update=None): the caller steps the pieces itself; "
                            "pass an optax transformation or an update function to call it")
        shards = self.scatter(grads)
        if self.optax:
            import optax
            params = self._jax(self.master)
            updates, self.state = self.update.update(self._jax(shards), self.state, params)
            new = optax.apply_updates(params, updates)
            for dtype, flat in self.master.items():
                flat[...] = np.asarray(new[dtype.name])
        else:
            self.state = self.update(self.master, shards, self.state)
        return self.gather()

    step = __call__

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state (its arrays), beside the master shard."""
        leaves, _ = flatten(self.state)
        return sum(int(getattr(leaf, "nbytes", 0)) for leaf in leaves)

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

    def state_dict(self) -> Dict[str, Any]:
        """{"params": the master parameters, "state": the optimizer state},
        every per-element part gathered whole, laid out like the parameters
        (collective: every rank gets it; save it on one). Loads into a Sharded
        at any world size (``load_state_dict``)."""
        _, spec = flatten(self.params)

        def whole(node: Any) -> Any:
            if self._per_element(node):
                keys = "names" if all(isinstance(k, str) for k in node) else "dtypes"
                return {_WHOLE: unflatten(spec, self.gathered(node)), "keys": keys}
            return _map_children(node, whole)
        return {"params": unflatten(spec, self.gathered(self.master)),
                "state": whole(self.state)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take this rank's shard of ``state_dict`` (from ``state_dict()`` at
        any world size): the master parameters and the optimizer state; the
        parameters themselves are the caller's to restore."""
        comm = self.reducer.comm
        if self.placed != (comm.Get_rank(), comm.Get_size()):
            self.place()                     # ranks were lost: reshard

        def mine(tree: Any) -> Shards:
            host = self._host(tree)
            return self.joined(lambda piece: piece.of(host[piece.index]))

        def shard(node: Any) -> Any:
            if isinstance(node, dict) and _WHOLE in node:
                part = mine(node[_WHOLE])
                if self.optax:
                    return self._jax(part)
                return part if node["keys"] == "dtypes" else {d.name: a for d, a in part.items()}
            return _map_children(node, shard)
        for dtype, flat in mine(state_dict["params"]).items():
            self.master[dtype][...] = flat
        self.state = shard(state_dict["state"])

    def free(self) -> None:
        """Free the Reducer this step made (not one it was given)."""
        if self._owns_reducer:
            self.reducer.free()

    @staticmethod
    def _host(tree: Any) -> List[np.ndarray]:
        """The leaves of ``tree`` as host numpy arrays (views where they can be)."""
        leaves, _ = flatten(tree)
        host, _ = to_host(leaves, inplace=False)
        return [np.asarray(h) for h in host]

    @staticmethod
    def _jax(shards: Shards) -> Dict[str, Any]:
        import jax.numpy as jnp
        return {dtype.name: jnp.asarray(shard) for dtype, shard in shards.items()}


def _cut(flat: np.ndarray, sizes: List[int]) -> Iterator[np.ndarray]:
    """``flat`` cut into consecutive parts of ``sizes``."""
    offset = 0
    for size in sizes:
        yield flat[offset:offset + size]
        offset += size


def _slices(flat: np.ndarray, ranges: List[Any]) -> Iterator[Piece]:
    """The pieces of ``ranges`` ((index, first, stop)) as slices of ``flat``."""
    for (index, first, stop), values in zip(ranges, _cut(flat, [b - a for _, a, b in ranges])):
        yield Piece(index, first, stop, values, copy=True)


def _set_elements(array: np.ndarray, first: int, stop: int, values: np.ndarray) -> None:
    """Write ``values`` (cast) into ``array``'s elements [first, stop) in C order."""
    if array.flags.c_contiguous:
        assign(array.reshape(-1)[first:stop], values)
    else:
        array[np.unravel_index(np.arange(first, stop), array.shape)] = values.astype(array.dtype)


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

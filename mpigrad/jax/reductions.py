"""Reductions of jax pytrees, inside ``jax.jit`` and outside it.

Inside a traced function every leaf of one call goes to one host call
(``host_call.into``: XLA's buffers), where the Reducer's own ``reduce(leaves,
out=results)`` runs: the same plan, backends, mean and checks as outside jit,
so the same bits, read out of the operands and written into the results. Sums and means are linear: their
gradient (a custom VJP) is the same reduction of the cotangents.
"""

import threading
from typing import Any, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .._collective.ops import METRICS, check_op
from ..collectives import allreduce as host_allreduce
from ..reducer import Reducer
from .host_call import Run, into, traced

__all__ = ["reduce", "allreduce", "default_reducer"]

_default: List[Reducer] = []
_default_lock = threading.Lock()


def default_reducer() -> Reducer:
    """The Reducer ``reduce`` uses when given none: the mean over COMM_WORLD
    (made at the first call, on every rank: collective)."""
    with _default_lock:
        if not _default:
            _default.append(Reducer())
        return _default[0]


def _linear(leaves: Sequence[Any], run: Run) -> List[Any]:
    """``run`` on the host over ``leaves`` (traced), its gradient the same
    ``run`` over the cotangents (a sum's or a mean's)."""
    @jax.custom_vjp
    def reduced(*values: Any) -> Any:
        return tuple(into(values, run))

    def forward(*values: Any) -> Any:
        return reduced(*values), None

    def backward(_: Any, cotangents: Any) -> Any:
        return tuple(into(cotangents, run))

    reduced.defvjp(forward, backward)
    return list(reduced(*leaves))


def reduce(tree: Any, reducer: Optional[Reducer] = None) -> Any:
    """``reducer``'s reduction (default: the mean over COMM_WORLD) of every
    rank's pytree of arrays, in the same structure.

    Inside ``jax.jit`` (and ``lax.scan``, ``lax.cond``, ``vmap``: batched
    into one call; not on per-device values inside ``shard_map``: a
    ValueError naming the fix) as outside it, with the bits ``reducer.reduce`` gives for
    the same arrays; under ``jax.grad`` its gradient is the same reduction of
    the cotangents. A difference across ranks, a local error, a lost or
    stalled rank raise on every rank: inside jit as the jitted call's error
    (jax's JaxRuntimeError, whose message holds mpigrad's)."""
    reducer = default_reducer() if reducer is None else reducer
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not traced(leaves, "mpigrad.jax.reduce"):
        return reducer.reduce(tree)

    bare = jax.tree_util.treedef_is_leaf(treedef)     # a single array, not a tree of them

    def run(inputs: List[np.ndarray], outputs: List[np.ndarray]) -> None:
        # in the caller's structure: a difference across ranks names the leaf's path
        def tree(arrays: List[np.ndarray]) -> Any:
            return arrays if bare else jax.tree_util.tree_unflatten(treedef, arrays)
        reducer.reduce(tree(inputs), out=tree(outputs))
    return jax.tree_util.tree_unflatten(treedef, _linear(leaves, run))


def allreduce(value: Any, op: str = "mean", reducer: Optional[Reducer] = None) -> Any:
    """``mpigrad.allreduce`` of a metric (an array or a pytree of them) over
    COMM_WORLD (or ``reducer``'s communicator): ``op`` "sum", "mean", "max"
    or "min"; inside ``jax.jit`` as outside it. A mean of integers gives
    float32 inside jit. The gradient of a sum or a mean is the same
    reduction of the cotangents; max and min have none."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    # at trace time too (a host call cannot refuse it): the op table's rules for metrics
    check_op(op, (jnp.result_type(leaf) for leaf in leaves), "mpigrad.jax.allreduce", METRICS)
    if not traced(leaves, "mpigrad.jax.allreduce"):
        if reducer is not None:
            return reducer.allreduce(value, op)
        return host_allreduce(value, op)
    if op == "mean":
        leaves = [leaf if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
                  else jnp.asarray(leaf, np.float32) for leaf in leaves]

    def run(inputs: List[np.ndarray], outputs: List[np.ndarray]) -> None:
        results = (reducer.allreduce(inputs, op) if reducer is not None
                   else host_allreduce(inputs, op))
        for output, result in zip(outputs, results):
            output[...] = result
    out = _linear(leaves, run) if op in ("sum", "mean") else into(leaves, run)
    return jax.tree_util.tree_unflatten(treedef, out)

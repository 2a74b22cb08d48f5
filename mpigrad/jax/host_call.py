"""One host call inside a traced jax function, in place on XLA's buffers.

``in_place(arrays, run)`` hands ``run`` numpy views of ``arrays`` (XLA's own
buffers, written in place: ``jax.experimental.buffer_callback`` with every
input aliased to its output, zero-copy) and returns the arrays ``run`` wrote.
Where jax has no ``buffer_callback`` it falls back to
``io_callback(ordered=True)`` (a copy in and out).

XLA may run independent callbacks of one program at once, on several
threads and in a different order on each rank, where collectives must run
in one order on every rank. So the calls traced into one function form a
chain: each takes a token the one before it returned (a data dependency
XLA keeps), and ``run`` holds one process-wide lock.
"""

import threading
from typing import Any, Callable, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

try:                                  # jax >= 0.8 (jax.core's is deprecated there)
    from jax.extend.core import get_opaque_trace_state
except ImportError:                   # pragma: no cover - jax 0.7
    from jax.core import get_opaque_trace_state

buffer_callback: Optional[Callable[..., Any]]
try:                                  # jax >= 0.7: XLA's buffers, in place
    from jax.experimental import buffer_callback as _buffers
    buffer_callback = _buffers.buffer_callback
except ImportError:                   # pragma: no cover - older jax: a copy in and out
    buffer_callback = None

__all__ = ["in_place", "traced", "zero_copy"]

#: whether calls run on XLA's own buffers (False: copied through io_callback)
zero_copy = buffer_callback is not None

_TOKEN = jax.ShapeDtypeStruct((), np.int32)
_host_lock = threading.Lock()         # one mpigrad host call at a time in a process
_chain_lock = threading.Lock()


class _Chain:
    """The last call traced into the current function: (its trace, its token)."""

    trace: Any = None
    token: Any = None


_chain = _Chain()


def _previous_token() -> Any:
    """The token of the call traced before this one into the same function,
    or a fresh one (the first call of a trace)."""
    state = get_opaque_trace_state()
    with _chain_lock:
        if _chain.trace is not None and _chain.trace == state:
            return _chain.token
    return jnp.zeros((), np.int32)


def _remember(token: Any) -> None:
    state = get_opaque_trace_state()
    with _chain_lock:
        _chain.trace, _chain.token = state, token


def in_place(arrays: Sequence[Any], run: Callable[[List[np.ndarray]], None]) -> List[Any]:
    """``run(views)`` on the host, inside the traced function, where ``views``
    are writable numpy arrays holding ``arrays``' values; returns the arrays
    as ``run`` left them (same shapes and dtypes)."""
    arrays = [jnp.asarray(a) for a in arrays]
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    token = _previous_token()
    if buffer_callback is not None:
        def on_buffers(ctx: Any, outs: Sequence[Any], *ins: Any) -> None:
            del ctx, ins                  # aliased: outs hold the inputs' values
            views = [np.asarray(out) for out in outs[:-1]]
            with _host_lock:
                run(views)
            np.asarray(outs[-1])[...] = 0
        call = buffer_callback(on_buffers, [*shapes, _TOKEN], has_side_effect=True,
                               vmap_method="broadcast_all",
                               input_output_aliases={i: i for i in range(len(arrays) + 1)})
        *results, token = call(*arrays, token)
    else:                             # older jax (and tests): a copy in and out
        def on_copies(*values: np.ndarray) -> List[np.ndarray]:
            views = [np.array(v) for v in values[:-1]]
            with _host_lock:
                run(views)
            return [*views, np.zeros((), np.int32)]
        *results, token = io_callback(on_copies, [*shapes, _TOKEN], *arrays, token,
                                      ordered=True)
    _remember(token)
    return list(results)


def traced(leaves: Sequence[Any], what: str) -> bool:
    """Whether any of ``leaves`` is a jax tracer (the call is being traced);
    ValueError (at trace time: on every rank) for values that vary over a
    ``shard_map``'s devices: each device's shard would make its own host call,
    in an order that may differ across ranks, pairing different devices'
    shards."""
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return False
    axes = sorted({axis for leaf in leaves for axis in _varying_axes(leaf)})
    if axes:
        raise ValueError(
            f"{what} inside shard_map (values varying over mesh axes {axes}): expecting "
            "values that are the same on every device of the process; reduce them over "
            "the mesh first (jax.lax.psum / pmean over those axes), or call "
            f"{what} outside shard_map")
    return True


def _varying_axes(leaf: Any) -> Any:
    """The shard_map mesh axes ``leaf`` varies over (jax's type says; jax
    versions name it ``manual_axis_type.varying`` or ``vma``; () where neither)."""
    aval = jax.typeof(leaf)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return getattr(manual, "varying", ())
    return getattr(aval, "vma", None) or ()


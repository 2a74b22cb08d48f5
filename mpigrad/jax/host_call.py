"""One host call inside a traced jax function, on XLA's own buffers, ordered
by construction.

``into(arrays, run)`` hands ``run`` numpy arrays holding ``arrays``' values and
as many writable ones of the same shapes and dtypes, which it fills, and returns
those. On the CPU both are XLA's own buffers (the operands and the results:
zero-copy, no copy of the operands into the results either); on other
platforms, host copies.

Collectives must run in one order on every rank, while XLA runs independent
operations of one program at once, on several threads, in an order of its
own per run. So every host call carries an effect of mpigrad's, registered
with jax as *ordered*: jax threads one token through every such call of a
program, in the order they were traced, across ``custom_vjp``, ``scan``,
``cond``, ``vmap`` and ``checkpoint``, and across successive jitted calls;
XLA cannot start a call before the one traced before it has returned. The
same program traces the same calls on every rank, so every rank runs them
in the same order, whatever the threads' timing. Where this jax lacks the
internals it is built on (``jax._src``: effects, FFI lowering), the calls
go through ``io_callback(ordered=True)``, ordered by jax's own token (a copy
in and out).
"""

import dataclasses
from typing import Any, Callable, List, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

#: what a host call runs: run(inputs, outputs) fills the outputs (writable), in order
Run = Callable[[List[np.ndarray], List[np.ndarray]], None]

__all__ = ["into", "traced", "zero_copy", "ordered_primitive", "Run"]

try:                                   # jax's internals the ordered primitive is built on
    from jax._src import buffer_callback as _buffers   # noqa: F401 (its CPU target exists)
    from jax._src import core as _core
    from jax._src import dispatch as _dispatch
    from jax._src import effects as _effects
    from jax._src import ffi as _ffi
    from jax._src.callback import emit_python_callback as _emit_python_callback
    from jax._src.interpreters import batching as _batching
    from jax._src.interpreters import mlir as _mlir
    _INTERNALS = True
except ImportError:                    # pragma: no cover - a jax that moved them
    _INTERNALS = False


class _Ordered:
    """Which path ``into`` takes: mpigrad's ordered primitive (True), or
    ``io_callback(ordered=True)`` (False; tests switch to it)."""

    primitive = _INTERNALS


ordered_primitive = _Ordered()

#: whether calls on the CPU run on XLA's own buffers (False: copied in and out)
zero_copy = _INTERNALS


def into(arrays: Sequence[Any], run: Run) -> List[Any]:
    """``run(inputs, outputs)`` on the host, inside the traced function, in the
    program's one order of host calls; returns the outputs as ``run`` filled
    them."""
    arrays = [jnp.asarray(a) for a in arrays]
    if ordered_primitive.primitive:
        return list(_host_call_p.bind(*arrays, run=_Callback(run)))

    def on_copies(*values: np.ndarray) -> List[np.ndarray]:
        outputs = [np.empty_like(v) for v in values]
        run([np.asarray(v) for v in values], outputs)
        return outputs
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    return list(io_callback(on_copies, shapes, *arrays, ordered=True))


@dataclasses.dataclass(frozen=True, eq=False)
class _Callback:
    """A host call's ``run`` as a primitive's parameter (hashed by identity)."""

    run: Run


if _INTERNALS:
    class HostCallEffect(_effects.Effect):
        """mpigrad's host calls: ordered (one token through every call of a
        program), allowed inside control flow, custom derivatives and remat."""

        def __str__(self) -> str:
            return "mpigrad host call"

    _EFFECT = HostCallEffect()
    for _kind in (_effects.lowerable_effects, _effects.ordered_effects,
                  _effects.control_flow_allowed_effects,
                  _effects.custom_derivatives_allowed_effects, _effects.remat_allowed_effects):
        _kind.add_type(HostCallEffect)

    _host_call_p = _core.Primitive("mpigrad_host_call")
    _host_call_p.multiple_results = True
    _dispatch.simple_impl(_host_call_p)

    @_host_call_p.def_effectful_abstract_eval
    def _abstract_eval(*avals: Any, run: _Callback) -> Any:
        del run
        return [_core.ShapedArray(a.shape, a.dtype) for a in avals], {_EFFECT}

    def _batched(args: Sequence[Any], dims: Sequence[Any], *, run: _Callback) -> Any:
        """Under vmap, one call of the whole batch (a reduction is elementwise
        over the ranks): every argument broadcast to the batch, its axis first."""
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        whole = [jnp.broadcast_to(a, (size, *a.shape)) if d is None
                 else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        return _host_call_p.bind(*whole, run=run), [0] * len(whole)

    _batching.primitive_batchers[_host_call_p] = _batched

    def _with_token(ctx: Any) -> Any:
        """``ctx`` for a call that takes a token first and returns one first."""
        return dataclasses.replace(ctx, avals_in=[_core.abstract_token, *ctx.avals_in],
                                   avals_out=[_core.abstract_token, *ctx.avals_out])

    def _lower_on_buffers(ctx: Any, *args: Any, run: _Callback) -> Any:
        """The CPU: XLA's FFI buffer callback on the operands' and the results' own
        buffers (not aliased: an operand XLA still holds would be copied into its
        result first), the effect's token in and out."""
        count = len(args)

        def on_buffers(exec_ctx: Any, *buffers: Any) -> Any:
            del exec_ctx                     # buffers: token, inputs, token, outputs
            run.run([np.asarray(a) for a in buffers[1:count + 1]],
                    [np.asarray(out) for out in buffers[count + 2:]])
            return ()
        ctx.module_context.add_host_callback(on_buffers)
        index = np.uint64(len(ctx.module_context.host_callbacks) - 1)
        lower = _ffi.build_ffi_lowering_function(
            "xla_buffer_python_cpu_callback", has_side_effect=True)
        token, *results = lower(_with_token(ctx), ctx.tokens_in.get(_EFFECT), *args,
                                index=index).results
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(_mlir.TokenSet({_EFFECT: token})))
        return results

    def _lower_on_copies(ctx: Any, *args: Any, run: _Callback) -> Any:
        """Other platforms: a host callback on copies, the effect's token in and out."""
        def on_copies(*values: Any) -> Any:
            outputs = [np.empty_like(v) for v in values]
            run.run([np.asarray(v) for v in values], outputs)
            return outputs
        results, token, _ = _emit_python_callback(
            ctx, on_copies, ctx.tokens_in.get(_EFFECT), list(args), ctx.avals_in,
            ctx.avals_out, has_side_effect=True, returns_token=True)
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(_mlir.TokenSet({_EFFECT: token})))
        return results

    _mlir.register_lowering(_host_call_p, _lower_on_copies)
    _mlir.register_lowering(_host_call_p, _lower_on_buffers, platform="cpu")


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

"""The compiled step's host call (GRAPH_MODE, ``ms.jit``): one op in the graph that
runs Python on the gradients.

Where a C compiler works, an ``ops.Custom(func_type="aot")`` op whose kernel is
mpigrad's trampoline (``_base/host_call.c``): MindSpore hands it the step's own
input and output buffers, which reach ``run(inputs, outputs)`` as numpy views, no
copy made. Its first input is the op's key (an int64 scalar tensor): one trampoline
serves every reducer. Elsewhere an ``ops.Custom(func_type="pyfunc")`` op, which
receives copies of the inputs and copies the arrays it returns into its outputs.
Both keep program order (``side_effect_io``). A compiled construct calls ``op``
with ``key_tensor`` first where that is not None, else ``op`` alone, a scalar
(0-d) input and output ``reshaped`` to (1,) and back (HostOp).
"""

import ctypes
import functools
import inspect
import itertools
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import ops

from .._base import native
from .._base.bfloat16 import bfloat16_dtype, dtype_named
from .tensors import from_mindspore_bfloat16

__all__ = ["HostOp", "reshaped"]

#: run(inputs, outputs): writes the outputs
Into = Callable[[Sequence[np.ndarray], Sequence[np.ndarray]], None]
#: run(inputs): returns the outputs
Copying = Callable[[Sequence[np.ndarray]], Tuple[np.ndarray, ...]]

#: a host call's buffers as MindSpore describes them: every buffer's address, shape, dtype name
Described = Tuple[Tuple[int, ...], Tuple[Tuple[int, ...], ...], Tuple[bytes, ...]]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                             ctypes.POINTER(ctypes.c_int),
                             ctypes.POINTER(ctypes.POINTER(ctypes.c_int64)),
                             ctypes.POINTER(ctypes.c_char_p))
_ops: Dict[int, "HostOp"] = {}      # key -> its live op
_keys = itertools.count(1)


class HostOp:
    """One host call in a compiled step, taking one tensor per shape in ``shapes``
    (of ``dtypes``, MindSpore's) and giving as many, of the same shapes and dtypes
    (a 0-d one as shape (1,): the step passes those, ``scalars``, through
    ``reshaped``; the host sees them 0-d).

    Args:
        into: ``run(inputs, outputs)`` on numpy views of the step's buffers (the
            aot op).
        copying: ``run(inputs)`` returning the outputs (the pyfunc op, where no
            compiler builds the trampoline).
    """

    def __init__(self, shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[Any],
                 into: Into, copying: Copying) -> None:
        self.into = into
        self.failure: Optional[BaseException] = None     # the last call's, if it failed
        # MindSpore's Custom ops take a 0-d tensor for a scalar: a 0-d output comes back
        # as a Python number (a compiled step's optimizer then leaves its parameter as
        # it was; a bfloat16 one is read as float16), and pyfunc hands a 0-d input over
        # as one (a bfloat16 one not at all). The op takes and gives them as shape (1,):
        # a compiled step passes those positions (``scalars``) through ``reshaped``;
        # the host sees them 0-d
        self.shapes = [tuple(shape) for shape in shapes]
        self.scalars = tuple(i for i, shape in enumerate(self.shapes) if not shape)
        declared = tuple(shape or (1,) for shape in self.shapes)
        # the numpy views of the buffers last described (a view costs ~3 us: ~1 ms a step
        # of ResNet-50's 161 gradients in and out), made again only where they moved
        self.views: Tuple[Optional[Described], Tuple[List[np.ndarray], List[np.ndarray]]] = \
            (None, ([], []))
        trampoline = _trampoline()
        self.route = "aot" if trampoline is not None else "pyfunc"
        if trampoline is not None:
            self.key = next(_keys)
            _ops[self.key] = self
            self.op = ops.Custom(f"{trampoline}:host_call", out_shape=declared,
                                 out_dtype=tuple(dtypes), func_type="aot")
            self.key_tensor: Optional[Any] = ms.Tensor(np.array([self.key], np.int64))
        else:
            self.key_tensor = None
            self.op = ops.Custom(self.copied(copying), out_shape=declared,
                                 out_dtype=tuple(dtypes), func_type="pyfunc")
        self.op.add_prim_attr("side_effect_io", True)

    def viewed(self, described: Described) -> Tuple[List[np.ndarray], List[np.ndarray]]:
        """(inputs, outputs): numpy views of the buffers ``described`` (the aot op's)."""
        arrays = [_array(*buffer) for buffer in zip(*described)]
        half = len(arrays) // 2
        return self.on_host(arrays[:half]), self.on_host(arrays[half:])

    def on_host(self, arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
        """The op's inputs (or outputs) as the host takes them: a scalar's 0-d (where it
        has one element: another shape is left for the host's check to name)."""
        return [array.reshape(()) if i in self.scalars and array.size == 1 else array
                for i, array in enumerate(arrays)]

    def copied(self, run: Copying) -> Callable[..., Tuple[np.ndarray, ...]]:
        """``run`` as the pyfunc op calls it: one array per input as as many positional
        parameters, with the signature that says so (pyfunc counts them); bfloat16 taken
        as ml_dtypes' and given back as its bits (no numpy bfloat16 type crosses pyfunc's
        copy); the outputs in the shapes declared."""
        def called(*arrays: np.ndarray) -> Tuple[np.ndarray, ...]:
            given = self.on_host([from_mindspore_bfloat16(a) for a in arrays])
            return tuple(_as_bits(out.reshape(shape or (1,)))
                         for out, shape in zip(run(given), self.shapes))
        setattr(called, "__signature__", inspect.Signature(
            [inspect.Parameter(f"grad{i}", inspect.Parameter.POSITIONAL_ONLY)
             for i in range(len(self.shapes))]))
        return called

    def release(self) -> None:
        """Forget the op (its steps have run): a later call of it fails."""
        if self.key_tensor is not None:
            _ops.pop(self.key, None)


def _as_bits(array: np.ndarray) -> np.ndarray:
    """``array``, bfloat16 viewed as its bits (uint16)."""
    return array.view(np.uint16) if array.dtype == bfloat16_dtype() else array


def reshaped(tensor: Any, shape: Tuple[int, ...]) -> Any:
    """In a compiled step: ``tensor`` (one element) in ``shape``, (1,) or () (see
    HostOp); bfloat16 through float32, exactly (MindSpore's CPU reshape takes no
    bfloat16)."""
    if tensor.dtype == ms.bfloat16:
        return ops.reshape(tensor.astype(ms.float32), shape).astype(ms.bfloat16)
    return ops.reshape(tensor, shape)


@functools.lru_cache(maxsize=None)
def _trampoline() -> Optional[str]:
    """The trampoline library's path, its callback set (None: no compiler)."""
    built, _ = native.host_call()
    if built is None:
        return None
    path, library = built
    library.set_host_call(_ON_HOST)
    return path


def _described(count: int, params: Any, ndims: Any, shapes: Any, dtypes: Any) -> Described:
    """The description of buffers 1 to ``count`` - 1 (after the key)."""
    return (tuple(params[1:count]),
            tuple([tuple(shapes[i][:ndims[i]]) for i in range(1, count)]),
            tuple(dtypes[1:count]))


class _Memory:
    """Memory at an address, as numpy takes it (its array interface): a view
    made in half the time a ctypes buffer takes."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, shape: Tuple[int, ...], dtype: np.dtype) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": shape,
                                    "typestr": dtype.str, "version": 3}


def _array(address: int, shape: Tuple[int, ...], dtype: bytes) -> np.ndarray:
    """A numpy view of ``shape`` at ``address``."""
    kind = dtype_named(dtype.decode())
    if 0 in shape:
        return np.empty(shape, kind)
    array = np.asarray(_Memory(address, shape, kind))
    return array if array.dtype == kind else array.view(kind)    # (bfloat16: a void type there)


@_CALLBACK
def _ON_HOST(count: int, params: Any, ndims: Any, shapes: Any, dtypes: Any) -> int:
    """The trampoline's callback: the op's key, its inputs, then its outputs."""
    host = None
    try:
        key = ctypes.cast(params[0], ctypes.POINTER(ctypes.c_int64))[0]
        host = _ops.get(key)
        if host is None:
            raise RuntimeError(f"mpigrad: host call {key} ran after its reducer was freed")
        described, views = _described(count, params, ndims, shapes, dtypes), host.views
        if views[0] != described:             # (a step's buffers: the same every step)
            views = host.views = (described, host.viewed(described))
        host.failure = None
        host.into(*views[1])
        return 0
    except BaseException as exc:        # MindSpore raises on a non-zero status: say why
        if host is not None:
            host.failure = exc
        print(f"mpigrad: the compiled step's host call failed: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return 1

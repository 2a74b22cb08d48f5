"""The compiled step's host call (GRAPH_MODE, ``ms.jit``): one op in the graph that
runs Python on the gradients.

Where a C compiler works, an ``ops.Custom(func_type="aot")`` op whose kernel is
mpigrad's trampoline (``_base/host_call.c``): MindSpore hands it the step's own
input and output buffers, which reach ``run(inputs, outputs)`` as numpy views, no
copy made. Its first input is the op's key (an int64 scalar tensor): one trampoline
serves every reducer. Elsewhere an ``ops.Custom(func_type="pyfunc")`` op, which
receives copies of the inputs and copies the arrays it returns into its outputs.
Both keep program order (``side_effect_io``). A compiled construct calls ``op``
with ``key_tensor`` first where that is not None, else ``op`` alone.
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
from .._base.bfloat16 import bfloat16_dtype

__all__ = ["HostOp"]

#: run(inputs, outputs): writes the outputs
Into = Callable[[Sequence[np.ndarray], Sequence[np.ndarray]], None]
#: run(inputs): returns the outputs
Copying = Callable[[Sequence[np.ndarray]], Tuple[np.ndarray, ...]]

_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                             ctypes.POINTER(ctypes.c_int),
                             ctypes.POINTER(ctypes.POINTER(ctypes.c_int64)),
                             ctypes.POINTER(ctypes.c_char_p))
_ops: Dict[int, "HostOp"] = {}      # key -> its live op
_keys = itertools.count(1)


class HostOp:
    """One host call in a compiled step, taking one tensor per shape in ``shapes``
    (of ``dtypes``, MindSpore's) and giving as many, of the same shapes and dtypes.

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
        # the numpy views of the buffers last described (a view costs ~3 us: ~1 ms a step
        # of ResNet-50's 161 gradients in and out), made again only where they moved
        self.views: Tuple[Optional[Described], List[np.ndarray]] = (None, [])
        trampoline = _trampoline()
        self.route = "aot" if trampoline is not None else "pyfunc"
        if trampoline is not None:
            self.key = next(_keys)
            _ops[self.key] = self
            self.op = ops.Custom(f"{trampoline}:host_call", out_shape=tuple(shapes),
                                 out_dtype=tuple(dtypes), func_type="aot")
            self.key_tensor: Optional[Any] = ms.Tensor(np.array([self.key], np.int64))
        else:
            self.key_tensor = None
            self.op = ops.Custom(_counted(copying, len(shapes)), out_shape=tuple(shapes),
                                 out_dtype=tuple(dtypes), func_type="pyfunc")
        self.op.add_prim_attr("side_effect_io", True)

    def release(self) -> None:
        """Forget the op (its steps have run): a later call of it fails."""
        if self.key_tensor is not None:
            _ops.pop(self.key, None)


def _counted(run: Copying, count: int) -> Callable[..., Tuple[np.ndarray, ...]]:
    """``run`` taking its ``count`` arrays as as many positional parameters, with the
    signature that says so (pyfunc counts them)."""
    def on_host(*arrays: np.ndarray) -> Tuple[np.ndarray, ...]:
        return run(arrays)
    setattr(on_host, "__signature__", inspect.Signature(
        [inspect.Parameter(f"grad{i}", inspect.Parameter.POSITIONAL_ONLY) for i in range(count)]))
    return on_host


@functools.lru_cache(maxsize=None)
def _trampoline() -> Optional[str]:
    """The trampoline library's path, its callback set (None: no compiler)."""
    built, _ = native.host_call()
    if built is None:
        return None
    path, library = built
    library.set_host_call(_ON_HOST)
    return path


#: a host call's buffers as MindSpore describes them: every buffer's address, shape, dtype name
Described = Tuple[Tuple[int, ...], Tuple[Tuple[int, ...], ...], Tuple[bytes, ...]]


def _described(count: int, params: Any, ndims: Any, shapes: Any, dtypes: Any) -> Described:
    """The description of buffers 1 to ``count`` - 1 (after the key)."""
    return (tuple(params[1:count]),
            tuple([tuple(shapes[i][:ndims[i]]) for i in range(1, count)]),
            tuple(dtypes[1:count]))


@functools.lru_cache(maxsize=None)
def _dtype(name: bytes) -> np.dtype:
    """The numpy dtype MindSpore names ``name``."""
    return bfloat16_dtype() if name == b"bfloat16" else np.dtype(name.decode())


class _Memory:
    """Memory at an address, as numpy takes it (its array interface): a view
    made in half the time a ctypes buffer takes."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, shape: Tuple[int, ...], dtype: np.dtype) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": shape,
                                    "typestr": dtype.str, "version": 3}


def _array(address: int, shape: Tuple[int, ...], dtype: bytes) -> np.ndarray:
    """A numpy view of ``shape`` at ``address``."""
    kind = _dtype(dtype)
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
            views = host.views = (described, [_array(*buffer) for buffer in zip(*described)])
        arrays = views[1]
        half = len(arrays) // 2
        host.failure = None
        host.into(arrays[:half], arrays[half:])
        return 0
    except BaseException as exc:        # MindSpore raises on a non-zero status: say why
        if host is not None:
            host.failure = exc
        print(f"mpigrad: the compiled step's host call failed: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return 1

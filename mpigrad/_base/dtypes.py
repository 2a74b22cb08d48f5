"""Wire-dtype policy and the casts between gradient and wire dtypes.

Half precision (float16, bfloat16) travels as float32; float32, float64 and the
complex types travel as they are, so no gradient is ever cast down.
"""

import sys
from typing import Any, Callable, Dict, Iterable, Optional

import numpy as np

from . import halfcast, native
from .arrays import torch_from_numpy
from .bfloat16 import bfloat16_dtype, is_bfloat16

__all__ = ["supported", "wire_dtype", "message_dtype", "check_gradient_dtype",
           "assign", "finite_limit"]

_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)

#: the wire dtype of each gradient dtype but bfloat16 (ml_dtypes' is only imported
#: when one is seen: see bfloat16.py), whose wire is float32
_WIRE: Dict[np.dtype, np.dtype] = {
    _F16: _F32,
    _F32: _F32,
    np.dtype(np.float64): np.dtype(np.float64),
    np.dtype(np.complex64): np.dtype(np.complex64),
    np.dtype(np.complex128): np.dtype(np.complex128),
}
_SUPPORTED_NAMES = ", ".join(["float16", "bfloat16", *(d.name for d in _WIRE if d != _F16)])


def __getattr__(name: str) -> Any:
    if name == "bfloat16":               # numpy's bfloat16, ml_dtypes imported now
        return bfloat16_dtype()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def supported(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is a gradient dtype mpigrad reduces."""
    return dtype in _WIRE or is_bfloat16(dtype)


def wire_dtype(dtype: Any) -> np.dtype:
    """The dtype a gradient of ``dtype`` is reduced in (KeyError for another dtype)."""
    given = np.dtype(dtype)
    if given in _WIRE:
        return _WIRE[given]
    if is_bfloat16(given):
        return _F32
    raise KeyError(given)


def message_dtype(dtype: Any, op: str) -> np.dtype:
    """The dtype an array of any numeric ``dtype`` travels in for ``op``
    ("sum", "mean", "max", "min", "prod"): floating point as its wire dtype,
    integers as they are, bools as int64 for sums and means and as bytes
    otherwise (MPI's MAX and MIN take no bools)."""
    given = np.dtype(dtype)
    if given.kind == "b":
        return np.dtype(np.int64 if op in ("sum", "mean") else np.uint8)
    return given if given.kind in "iu" else wire_dtype(given)


def check_gradient_dtype(dtype: Any, index: int) -> None:
    """Raise TypeError unless ``dtype`` is a gradient dtype mpigrad reduces."""
    dtype = np.dtype(dtype)
    if not dtype.isnative:
        order = {">": "big-endian", "<": "little-endian"}.get(dtype.byteorder, dtype.byteorder)
        raise TypeError(
            f"grads[{index}]: expecting the machine's byte order, got {order} "
            f"{dtype.newbyteorder('=').name} ({dtype.str!r}); convert it first with "
            "a.astype(a.dtype.newbyteorder('='))")
    if not supported(dtype):
        raise TypeError(
            f"grads[{index}]: expecting a floating or complex dtype "
            f"({_SUPPORTED_NAMES}), got {np.dtype(dtype).name}; "
            "cast it first or mark it in skip=")


_COMPILED_CAST_MIN = 1 << 16     # elements; below this numpy's call overhead is lower


def assign(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``, casting; exact (round to nearest even, subnormals,
    inf and nan kept).

    Large casts between half precision and float32 of contiguous arrays of one
    shape go through compiled kernels: mpigrad's C kernels (native.py: at the
    vector units' width, numpy's and ml_dtypes' bits), else torch's where the
    program has imported torch, else the numba ones of halfcast (float16) and
    ml_dtypes' own (bfloat16).
    """
    if (dst.size < _COMPILED_CAST_MIN or dst.dtype == src.dtype
            or dst.shape != src.shape or not (dst.flags.c_contiguous and src.flags.c_contiguous)):
        dst[...] = src
        return
    cast = _native_cast(dst.dtype, src.dtype) if native.library() is not None else None
    torch = sys.modules.get("torch")
    if cast is not None:
        cast(dst, src)
    elif torch is not None and (_half(dst.dtype) or _half(src.dtype)):
        torch_from_numpy(dst).copy_(torch_from_numpy(src))
    elif dst.dtype == _F32 and src.dtype == _F16:
        halfcast.to_float32(dst, src)
    elif dst.dtype == _F16 and src.dtype == _F32:
        halfcast.to_float16(dst, src)
    else:
        dst[...] = src


def _native_cast(dst: np.dtype, src: np.dtype) -> Optional[Callable[[np.ndarray, np.ndarray],
                                                                    None]]:
    """The C kernel that casts ``src`` to ``dst``, if one does."""
    if dst == _F32:
        if src == _F16:
            return halfcast.to_float32
        return halfcast.from_bfloat16_bits if is_bfloat16(src) else None
    if src == _F32:
        if dst == _F16:
            return halfcast.to_float16
        return halfcast.to_bfloat16_bits if is_bfloat16(dst) else None
    return None


def _half(dtype: np.dtype) -> bool:
    return dtype == _F16 or is_bfloat16(dtype)


#: magnitudes from which a wire value rounds to infinity in the gradient dtype
#: (its largest finite value plus half a unit in the last place)
_FLOAT16_OVERFLOW, _BFLOAT16_OVERFLOW = 65520.0, 3.3895313892515355e38 + 2.0 ** 119


def _overflow(dtype: np.dtype) -> float:
    if dtype == _F16:
        return _FLOAT16_OVERFLOW
    return _BFLOAT16_OVERFLOW if is_bfloat16(dtype) else np.inf


def finite_limit(dtypes: Iterable[Any]) -> float:
    """The magnitude below which a wire value stays finite once cast back to
    every one of ``dtypes`` (inf for float32 and wider)."""
    return min((_overflow(np.dtype(d)) for d in dtypes), default=np.inf)

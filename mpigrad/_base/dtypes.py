"""Wire-dtype policy and the casts between gradient and wire dtypes.

Half precision (float16, bfloat16) travels as float32; float32, float64 and the
complex types travel as they are, so no gradient is ever cast down.
"""

import sys
from typing import Any, Dict, Iterable

import numpy as np

from . import halfcast
from .arrays import bfloat16, torch_from_numpy

__all__ = ["bfloat16", "SUPPORTED", "wire_dtype", "message_dtype", "check_gradient_dtype",
           "assign", "finite_limit"]

_WIRE: Dict[np.dtype, np.dtype] = {
    np.dtype(np.float16): np.dtype(np.float32),
    bfloat16: np.dtype(np.float32),
    np.dtype(np.float32): np.dtype(np.float32),
    np.dtype(np.float64): np.dtype(np.float64),
    np.dtype(np.complex64): np.dtype(np.complex64),
    np.dtype(np.complex128): np.dtype(np.complex128),
}

SUPPORTED = tuple(_WIRE)
_SUPPORTED_NAMES = ", ".join(d.name for d in SUPPORTED)


def wire_dtype(dtype: Any) -> np.dtype:
    """The dtype a gradient of ``dtype`` is reduced in."""
    return _WIRE[np.dtype(dtype)]


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
    if dtype not in _WIRE:
        raise TypeError(
            f"grads[{index}]: expecting a floating or complex dtype "
            f"({_SUPPORTED_NAMES}), got {np.dtype(dtype).name}; "
            "cast it first or mark it in skip=")


_HALF = (np.dtype(np.float16), bfloat16)
_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)
_COMPILED_CAST_MIN = 1 << 16     # elements; below this numpy's call overhead is lower


def assign(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``, casting; exact (round to nearest even, subnormals,
    inf and nan kept).

    Large casts between half precision and float32 of contiguous arrays of one
    shape go through compiled kernels: torch's when the program has already
    imported torch, else mpigrad.halfcast's for float16 (numpy's bits, 2.5-4x
    faster than numpy's own casts; bfloat16 keeps ml_dtypes' casts, which are
    about as fast as a copy).
    """
    if (dst.size < _COMPILED_CAST_MIN or dst.dtype == src.dtype
            or dst.shape != src.shape or not (dst.flags.c_contiguous and src.flags.c_contiguous)):
        dst[...] = src
        return
    torch = sys.modules.get("torch")
    if torch is not None and (dst.dtype in _HALF or src.dtype in _HALF):
        torch_from_numpy(dst).copy_(torch_from_numpy(src))
    elif dst.dtype == _F32 and src.dtype == _F16:
        halfcast.to_float32(dst, src)
    elif dst.dtype == _F16 and src.dtype == _F32:
        halfcast.to_float16(dst, src)
    else:
        dst[...] = src


#: magnitudes from which a wire value rounds to infinity in the gradient dtype
#: (its largest finite value plus half a unit in the last place)
_OVERFLOW = {np.dtype(np.float16): 65520.0, bfloat16: 3.3895313892515355e38 + 2.0 ** 119}


def finite_limit(dtypes: Iterable[Any]) -> float:
    """The magnitude below which a wire value stays finite once cast back to
    every one of ``dtypes`` (inf for float32 and wider)."""
    return min((_OVERFLOW.get(np.dtype(d), np.inf) for d in dtypes), default=np.inf)

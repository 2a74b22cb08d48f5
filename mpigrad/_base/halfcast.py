"""Exact float16 <-> float32 casts of contiguous arrays, and a float32 sum
with a half-precision addend cast inside it (the sums themselves, fused with the
mean, the finite check and the one rounding: fused_sum.py).

numpy's own float16 casts run a scalar routine per element, several times
slower than a float32 copy. These kernels give numpy's results bit for bit
(round to nearest even, subnormals, infinities, and NaN payloads kept as numpy
keeps them) near copy speed (docs/performance.md): branch-free bit arithmetic
that the compiler vectorises, with the float unit doing the subnormal rounding.
The kernels are C (``kernels.c``, compiled for this machine's vector units at
the first large cast: ``native.py``) where a compiler works, else numba's
(``halfcast_kernels.py``: the same formulas and bits, 5-20x slower; numba is
imported, and they are compiled once per machine, at their first use).
"""

from typing import Any

import numpy as np

from . import native
from .address import address

__all__ = ["to_float32", "to_float16", "to_bfloat16_bits", "from_bfloat16_bits", "add_half"]


def _kernels() -> Any:
    """The numba kernels (mpigrad._base.halfcast_kernels: numba is imported on first use)."""
    from . import halfcast_kernels
    return halfcast_kernels


def _flat(array: np.ndarray, dtype: Any) -> np.ndarray:
    return array.reshape(-1).view(dtype)


def to_float32(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for C-contiguous float32 ``dst`` and float16 ``src``
    of the same shape."""
    c = native.library()
    if c is not None:
        c.f16_to_f32(address(src), address(dst), dst.size)
    else:
        _kernels().up(_flat(src, np.uint16), _flat(dst, np.uint32))


def to_float16(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for C-contiguous float16 ``dst`` and float32 ``src``
    of the same shape, rounded to nearest even as numpy rounds."""
    c = native.library()
    if c is not None:
        c.f32_to_f16(address(src), address(dst), dst.size)
    else:
        _kernels().down(_flat(src, np.uint32), _flat(dst, np.uint16))


def to_bfloat16_bits(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst`` (uint16, or bfloat16) = the bfloat16 bits of the float32 ``src``
    (C-contiguous, the same size), rounded to nearest even."""
    c = native.library()
    if c is not None:
        c.f32_to_bf16(address(src), address(dst), dst.size)
    else:
        _kernels().bfloat16_down(_flat(src, np.uint32), _flat(dst, np.uint16))


def from_bfloat16_bits(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst`` (float32) = the bfloat16 values whose bits are ``src`` (uint16, or
    bfloat16; C-contiguous, the same size): exact."""
    c = native.library()
    if c is not None:
        c.bf16_to_f32(address(src), address(dst), dst.size)
    else:
        np.left_shift(_flat(src, np.uint16), 16, out=_flat(dst, np.uint32), dtype=np.uint32)


def add_half(acc: np.ndarray, src: np.ndarray, scratch: np.ndarray) -> None:
    """``acc += src`` for C-contiguous float32 ``acc`` and float16 or bfloat16
    ``src`` of one size: fused where the C kernels run, else cast into
    ``scratch`` (float32, as large) first. The same bits either way (the cast
    is exact)."""
    c = native.library()
    if c is not None:
        (c.add_f16 if src.dtype == np.float16 else c.add_bf16)(
            address(acc), address(src), acc.size)
        return
    (to_float32 if src.dtype == np.float16 else from_bfloat16_bits)(scratch, src)
    np.add(acc, scratch, out=acc)

"""Exact float16 <-> float32 casts of contiguous arrays, compiled with numba;
and the half-precision wires' kernels (float32 to bfloat16 bits, and a float32
sum of rows of bfloat16 bits, or of float16 values, rounded once).

numpy's own float16 casts run a scalar routine per element, several times
slower than a float32 copy. These kernels give numpy's results bit for bit
(round to nearest even, subnormals, infinities, and NaN payloads kept as numpy
keeps them) near copy speed (docs/performance.md): branch-free bit arithmetic
that the compiler vectorises, with the float unit doing the subnormal rounding.
numba is imported, and the kernels compiled (once per machine: numba caches
them on disk), at the first large cast.
"""

from typing import Any

import numpy as np

__all__ = ["to_float32", "to_float16", "to_bfloat16_bits", "from_bfloat16_bits",
           "sum_bfloat16_rows", "sum_float16_rows"]


def _kernels() -> Any:
    """The compiled kernels (mpigrad._base.halfcast_kernels: numba is imported on first use)."""
    from . import halfcast_kernels
    return halfcast_kernels


def to_float32(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for C-contiguous float32 ``dst`` and float16 ``src``
    of the same shape."""
    _kernels().up(src.reshape(-1).view(np.uint16), dst.reshape(-1).view(np.uint32))


def to_float16(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for C-contiguous float16 ``dst`` and float32 ``src``
    of the same shape, rounded to nearest even as numpy rounds."""
    _kernels().down(src.reshape(-1).view(np.uint32), dst.reshape(-1).view(np.uint16))


def to_bfloat16_bits(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst`` (uint16) = the bfloat16 bits of the float32 ``src`` (1-D, contiguous, the same
    size), rounded to nearest even."""
    _kernels().bfloat16_down(src.view(np.uint32), dst)


def from_bfloat16_bits(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst`` (float32) = the bfloat16 values whose bits are ``src`` (uint16): exact."""
    np.left_shift(src, 16, out=dst.view(np.uint32), dtype=np.uint32)


def sum_bfloat16_rows(dst: np.ndarray, rows: np.ndarray, scale: float = 1.0) -> None:
    """``dst`` (uint16, n) = the bfloat16 bits of each column of ``rows`` (uint16, (k, n), the
    bits of bfloat16 values) summed in float32 in row order, times ``scale`` (a power of
    two: exact): one rounding, at the end."""
    _kernels().sum_bfloat16_rows(rows, dst, np.float32(scale))


def sum_float16_rows(dst: np.ndarray, rows: np.ndarray, scale: float = 1.0) -> None:
    """``dst`` (float16, n) = each column of ``rows`` (float16, (k, n)) summed in float32 in
    row order, times ``scale`` (a power of two: exact): one rounding, at the end."""
    acc = np.empty(rows.shape[1], np.float32)
    term = np.empty_like(acc)
    to_float32(acc, rows[0])
    for row in rows[1:]:
        to_float32(term, row)
        acc += term
    if scale != 1.0:
        acc *= np.float32(scale)
    to_float16(dst, acc)

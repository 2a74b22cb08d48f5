"""Exact float16 <-> float32 casts of contiguous arrays, and the sums of half
precision: float16 or bfloat16 addends summed in float32 in one pass (the mean,
the finite check and the one rounding fused in; the node sums and the
half-precision wires' rows use it).

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

import ctypes
from typing import Any, Optional, Sequence

import numpy as np

from . import native
from .address import address

__all__ = ["to_float32", "to_float16", "to_bfloat16_bits", "from_bfloat16_bits", "add_half",
           "sum_half", "sum_bfloat16_rows", "sum_float16_rows"]


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


def sum_half(dst: np.ndarray, addends: Sequence[np.ndarray], factor: Optional[float] = None,
             limit: Optional[float] = None) -> Optional[bool]:
    """``dst`` = the ``addends`` (1-D float16 arrays, or bfloat16 ones or their uint16 bits,
    of one dtype and size, each C-contiguous) summed in float32 in their order, times ``factor`` (None: not scaled),
    then rounded once to ``dst``'s dtype (theirs), or kept in float32 where ``dst`` is
    float32; ``dst`` may be one of them. With a ``limit``, returns whether every float32
    result is finite and below it in magnitude (settle.py's check), else None. One pass
    where the C kernels run: the float32 sums never leave the cache."""
    c = native.library()
    first = addends[0]
    bf16 = first.dtype != np.float16
    if c is not None:
        pointers = (ctypes.c_void_p * len(addends))(*[address(a) for a in addends])
        ok = c.sum_half(pointers, len(addends), first.size, address(dst), bf16,
                        dst.dtype == np.float32, factor is not None,
                        1.0 if factor is None else float(factor), limit is not None,
                        0.0 if limit is None else float(limit))
        return None if limit is None else bool(ok)
    acc = dst if dst.dtype == np.float32 else np.empty(first.size, np.float32)
    term = np.empty(first.size, np.float32)
    (from_bfloat16_bits if bf16 else to_float32)(acc, first)
    with np.errstate(all="ignore"):       # nan and inf propagate, as in the trainer
        for addend in addends[1:]:
            add_half(acc, addend, term)
        if factor is not None:
            acc *= np.float32(factor)
        finite = None if limit is None else bool(acc.max() < limit and acc.min() > -limit)
    if acc is not dst:
        (to_bfloat16_bits if bf16 else to_float16)(dst, acc)
    return finite


def sum_bfloat16_rows(dst: np.ndarray, rows: np.ndarray, scale: float = 1.0) -> None:
    """``dst`` (uint16, n) = the bfloat16 bits of each column of ``rows`` (uint16, (k, n), the
    bits of bfloat16 values) summed in float32 in row order, times ``scale`` (a power of
    two: exact): one rounding, at the end."""
    sum_half(dst, list(rows), None if scale == 1.0 else scale)


def sum_float16_rows(dst: np.ndarray, rows: np.ndarray, scale: float = 1.0) -> None:
    """``dst`` (float16, n) = each column of ``rows`` (float16, (k, n)) summed in float32 in
    row order, times ``scale`` (a power of two: exact): one rounding, at the end."""
    sum_half(dst, list(rows), None if scale == 1.0 else scale)

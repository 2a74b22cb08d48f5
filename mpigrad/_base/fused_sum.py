"""The node sum's kernel: addends of one dtype (float16, bfloat16 or float32) summed
in float32 in their order, the mean, the finite check and (for half precision) the
one rounding fused in one pass, the sums never leaving the cache; and the
half-precision wires' row sums, the same kernel over a matrix's rows.

C (``kernels.c``: 16 lanes at a time through the vector units' conversions and
adds, the rare lanes holding a NaN, an infinity or a value past the check redone
by the exact formulas) where a compiler works, else numpy and the numba casts
(halfcast.py): the same bits.
"""

import ctypes
from typing import Optional, Sequence

import numpy as np

from . import native
from .address import address
from .halfcast import add_half, from_bfloat16_bits, to_bfloat16_bits, to_float16, to_float32

__all__ = ["fused_sum", "sum_bfloat16_rows", "sum_float16_rows"]

_KINDS = {np.dtype(np.float16): 0, np.dtype(np.float32): 2}     # else bfloat16 (bits): 1


def fused_sum(dst: np.ndarray, addends: Sequence[np.ndarray], factor: Optional[float] = None,
              limit: Optional[float] = None, stream: bool = False) -> Optional[bool]:
    """``dst`` = the ``addends`` (1-D arrays of one dtype and size, each C-contiguous:
    float16, float32, or bfloat16 or its uint16 bits) summed in float32 in their order,
    times ``factor`` (None: not scaled), then rounded once to ``dst``'s dtype (theirs),
    or kept in float32 where ``dst`` is float32; ``dst`` may be one of them. With a
    ``limit``, returns whether every float32 result is finite and below it in magnitude
    (settle.py's check), else None. ``stream``: ``dst`` is written past the cache (the C
    kernel's non-temporal stores), for memory nothing reads soon; the same bits."""
    first = addends[0]
    kind = _KINDS.get(first.dtype, 1)
    c = native.library()
    if c is not None:
        pointers = (ctypes.c_void_p * len(addends))(*[address(a) for a in addends])
        ok = c.fused_sum(pointers, len(addends), first.size, address(dst), kind,
                         dst.dtype == np.float32, factor is not None,
                         1.0 if factor is None else float(factor), limit is not None,
                         0.0 if limit is None else float(limit), stream)
        return None if limit is None else bool(ok)
    # the float32 sums grow in dst where no later addend is read out of it
    apart = dst.dtype != np.float32 or any(np.shares_memory(dst, a) for a in addends[1:])
    acc = np.empty(first.size, np.float32) if apart else dst
    with np.errstate(all="ignore"):       # nan and inf propagate, as in the trainer
        if kind == 2:
            np.copyto(acc, first)
            for addend in addends[1:]:
                np.add(acc, addend, out=acc)
        else:
            term = np.empty(first.size, np.float32)
            (from_bfloat16_bits if kind == 1 else to_float32)(acc, first)
            for addend in addends[1:]:
                add_half(acc, addend, term)
        if factor is not None:
            acc *= np.float32(factor)
        finite = None if limit is None else bool(acc.max() < limit and acc.min() > -limit)
    if acc is not dst:
        if dst.dtype == np.float32:
            np.copyto(dst, acc)
        else:
            (to_bfloat16_bits if kind == 1 else to_float16)(dst, acc)
    return finite


def sum_bfloat16_rows(dst: np.ndarray, rows: np.ndarray, scale: float = 1.0) -> None:
    """``dst`` (uint16, n) = the bfloat16 bits of each column of ``rows`` (uint16, (k, n), the
    bits of bfloat16 values) summed in float32 in row order, times ``scale`` (a power of
    two: exact): one rounding, at the end."""
    fused_sum(dst, list(rows), None if scale == 1.0 else scale)


def sum_float16_rows(dst: np.ndarray, rows: np.ndarray, scale: float = 1.0) -> None:
    """``dst`` (float16, n) = each column of ``rows`` (float16, (k, n)) summed in float32 in
    row order, times ``scale`` (a power of two: exact): one rounding, at the end."""
    fused_sum(dst, list(rows), None if scale == 1.0 else scale)

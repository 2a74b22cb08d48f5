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

from typing import Callable, Optional, Tuple

import numpy as np

__all__ = ["to_float32", "to_float16", "to_bfloat16_bits", "from_bfloat16_bits",
           "sum_bfloat16_rows", "sum_float16_rows"]

Kernel = Callable[[np.ndarray, np.ndarray], None]
_kernels: Optional[Tuple[Kernel, Kernel]] = None


def _compile() -> Tuple[Kernel, Kernel]:
    """(up, down): the compiled kernels over the arrays' bits."""
    import numba

    u32 = np.uint32

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def up(src: np.ndarray, dst: np.ndarray) -> None:
        rebias = np.float32(2.0 ** 112)
        for i in range(src.size):
            h = u32(src[i])
            # |h| moved to float32's bit positions is |x| * 2**-112 exactly
            # (subnormal halves become float32 subnormals): one exact multiply
            a = (h & u32(0x7FFF)) << u32(13)
            f = np.float32(np.uint32(a).view(np.float32) * rebias).view(np.uint32)
            # infinity and NaN: every exponent bit set, the payload kept
            f = (a | u32(0x7F800000)) if (h & u32(0x7C00)) == u32(0x7C00) else f
            dst[i] = f | ((h & u32(0x8000)) << u32(16))

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def down(src: np.ndarray, dst: np.ndarray) -> None:
        for i in range(src.size):
            f = u32(src[i])
            sign = (f >> u32(16)) & u32(0x8000)
            a = f & u32(0x7FFFFFFF)                           # |x|'s bits
            # normal halves: rebias the exponent and round the 13 dropped bits
            # to nearest even (a carry into the exponent is right, up to inf)
            h = (a - u32(0x38000000) + u32(0xFFF) + ((a >> u32(13)) & u32(1))) >> u32(13)
            # below 2**-14: adding 0.5 makes the float adder round |x| to a
            # multiple of 2**-24 (nearest even), the half's subnormal count
            sub = np.float32(np.uint32(a).view(np.float32) + np.float32(0.5)).view(np.uint32)
            h = (sub - u32(0x3F000000)) if a < u32(0x38800000) else h
            h = u32(0x7C00) if a >= u32(0x47800000) else h    # overflow and infinity
            # NaN: numpy keeps the payload's top 10 bits, and at least one set
            payload = (a >> u32(13)) & u32(0x3FF)
            nan = u32(0x7C00) | (payload if payload > u32(0) else u32(1))
            dst[i] = u32(sign | (nan if a > u32(0x7F800000) else h))

    return up, down


def _kernel(direction: int) -> Kernel:
    global _kernels
    if _kernels is None:
        _kernels = _compile()
    return _kernels[direction]


def to_float32(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for C-contiguous float32 ``dst`` and float16 ``src``
    of the same shape."""
    _kernel(0)(src.reshape(-1).view(np.uint16), dst.reshape(-1).view(np.uint32))


def to_float16(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for C-contiguous float16 ``dst`` and float32 ``src``
    of the same shape, rounded to nearest even as numpy rounds."""
    _kernel(1)(src.reshape(-1).view(np.uint32), dst.reshape(-1).view(np.uint16))


WireKernels = Tuple[Kernel, Callable[[np.ndarray, np.ndarray], None]]
_wire_kernels: Optional[WireKernels] = None


def _compile_wire() -> WireKernels:
    """(down, sum_rows) over bits: float32 to bfloat16 rounded to nearest even as ml_dtypes
    rounds (NaN stays NaN, quieted), and each column of a (rows, n) bfloat16 matrix summed in
    float32 in row order, then rounded once to bfloat16."""
    import numba

    u32 = np.uint32

    @numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
    def round_bits(f: np.uint32) -> np.uint32:
        rounded = (f + u32(0x7FFF) + ((f >> u32(16)) & u32(1))) >> u32(16)
        return ((f >> u32(16)) | u32(0x40)) if (f & u32(0x7FFFFFFF)) > u32(0x7F800000) \
            else rounded

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def down(src: np.ndarray, dst: np.ndarray) -> None:
        for i in range(src.size):
            dst[i] = round_bits(u32(src[i]))

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def sum_rows(rows: np.ndarray, dst: np.ndarray) -> None:
        for i in range(rows.shape[1]):
            acc = np.uint32(u32(rows[0, i]) << u32(16)).view(np.float32)
            for r in range(1, rows.shape[0]):
                acc += np.uint32(u32(rows[r, i]) << u32(16)).view(np.float32)
            dst[i] = round_bits(np.float32(acc).view(np.uint32))

    return down, sum_rows


def _wire(direction: int) -> Callable[[np.ndarray, np.ndarray], None]:
    global _wire_kernels
    if _wire_kernels is None:
        _wire_kernels = _compile_wire()
    return _wire_kernels[direction]


def to_bfloat16_bits(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst`` (uint16) = the bfloat16 bits of the float32 ``src`` (1-D, contiguous, the same
    size), rounded to nearest even."""
    _wire(0)(src.view(np.uint32), dst)


def from_bfloat16_bits(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst`` (float32) = the bfloat16 values whose bits are ``src`` (uint16): exact."""
    np.left_shift(src, 16, out=dst.view(np.uint32), dtype=np.uint32)


def sum_bfloat16_rows(dst: np.ndarray, rows: np.ndarray) -> None:
    """``dst`` (uint16, n) = the bfloat16 bits of each column of ``rows`` (uint16, (k, n), the
    bits of bfloat16 values) summed in float32 in row order: one rounding, at the end."""
    _wire(1)(rows, dst)


def sum_float16_rows(dst: np.ndarray, rows: np.ndarray) -> None:
    """``dst`` (float16, n) = each column of ``rows`` (float16, (k, n)) summed in float32 in
    row order: one rounding, at the end."""
    acc = np.empty(rows.shape[1], np.float32)
    term = np.empty_like(acc)
    to_float32(acc, rows[0])
    for row in rows[1:]:
        to_float32(term, row)
        acc += term
    to_float16(dst, acc)

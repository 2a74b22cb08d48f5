"""Exact float16 <-> float32 casts of contiguous arrays, compiled with numba.

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

__all__ = ["to_float32", "to_float16"]

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

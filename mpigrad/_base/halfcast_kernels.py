"""The numba kernels of mpigrad._base.halfcast (its docstring says what they
compute and why): module-level functions, so that numba's on-disk cache
(``cache=True``) serves every process after the first. Imported only at the
first large cast: importing numba costs a quarter second."""

import numba
import numpy as np

__all__ = ["up", "down", "bfloat16_down"]

u32 = np.uint32
jit = numba.njit(cache=True, nogil=True, boundscheck=False)


@jit
def up(src: np.ndarray, dst: np.ndarray) -> None:
    """float16 bits to float32 bits, exactly."""
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


@jit
def down(src: np.ndarray, dst: np.ndarray) -> None:
    """float32 bits to float16 bits, rounded to nearest even as numpy rounds."""
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


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def round_bits(f: np.uint32) -> np.uint32:
    """The bfloat16 bits of the float32 bits ``f``, rounded to nearest even as
    ml_dtypes rounds (NaN stays NaN, quieted)."""
    rounded = (f + u32(0x7FFF) + ((f >> u32(16)) & u32(1))) >> u32(16)
    return ((f >> u32(16)) | u32(0x40)) if (f & u32(0x7FFFFFFF)) > u32(0x7F800000) \
        else rounded


@jit
def bfloat16_down(src: np.ndarray, dst: np.ndarray) -> None:
    """float32 bits to bfloat16 bits (``round_bits`` of each)."""
    for i in range(src.size):
        dst[i] = round_bits(u32(src[i]))

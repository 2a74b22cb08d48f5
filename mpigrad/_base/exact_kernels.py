"""The numba kernels of exact sums (mpigrad._base.exact, whose module docstring
gives the method): module-level functions, so that numba's on-disk cache
(``cache=True``; beside the source, or in the user's cache directory where
the source tree is read-only) serves every process after the first. Imported
only where an exact sum runs: importing numba costs a quarter second."""

import math
from typing import Any, Tuple

import numba
import numpy as np

from .exact_units import LIMB_BITS, NONE, SCALE_ZERO, SPECIAL, ZERO

__all__ = ["grow", "exponents", "layout", "to_limbs", "to_limb_float32", "rounded",
           "rounded_odd"]

i64 = np.int64
mask = i64((1 << LIMB_BITS) - 1)
jit = numba.njit(cache=True, nogil=True, boundscheck=False)
inline = numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")


@inline
def top_bit(a: Any) -> Any:
    """The position of the top bit of 0 < a < 2**63."""
    e = math.frexp(np.float64(a))[1] - 1
    return e - 1 if (i64(1) << e) > a else e      # a rounded up to a power of 2


@inline
def split(b: Any) -> Any:
    """(m, q, msb) of the nonzero float64 with bits ``b``: |value| ==
    m * 2**q with m odd (< 2**53), and 2**msb its top bit."""
    e = (b >> 52) & 0x7FF
    m = b & i64(0xFFFFFFFFFFFFF)
    if e:
        m |= i64(1 << 52)
        q, msb = e - 1075, e - 1023
    else:
        q, msb = i64(-1074), top_bit(m) - 1074
    zeros = top_bit(m & -m)
    return m >> zeros, q + zeros, msb


@jit
def grow(parts: np.ndarray, x: np.ndarray, out: np.ndarray) -> int:
    """Grow-Expansion with zero elimination: out[:, i] = parts[:, i] + x[i]
    exactly, nonzero components first, increasing in magnitude."""
    used = 0
    for i in range(x.size):
        q = x[i]
        c = 0
        for k in range(parts.shape[0]):
            e = parts[k, i]
            if e == 0.0:
                break
            s = q + e                           # TwoSum: s + err == q + e
            b = s - q
            err = (q - (s - b)) + (e - b)
            q = s
            if err != 0.0:
                out[c, i] = err
                c += 1
        if q != 0.0:
            out[c, i] = q
            c += 1
        for k in range(c, out.shape[0]):
            out[k, i] = 0.0
        used = max(used, c)
    return used


@jit
def exponents(bits: np.ndarray, special: np.ndarray, out: np.ndarray) -> None:
    """``out[2i]``, ``out[2i+1]`` = the top bit, minus the lowest bit, of element i."""
    for i in range(bits.shape[1]):
        top, low = ZERO, NONE
        for k in range(bits.shape[0]):
            b = bits[k, i]
            if (b << 1) == 0:                   # +-0: the components end
                break
            m, q, msb = split(b)
            top = max(top, msb)
            low = min(low, q)
        if special[i] != 0.0:
            top = SPECIAL
        out[2 * i] = top
        out[2 * i + 1] = -low if low != NONE else ZERO


@jit
def layout(agreed: np.ndarray) -> Tuple[Any, bool]:
    """(The widest live element's bits, whether any element is special)."""
    widest, special = i64(0), False
    for i in range(agreed.size // 2):
        top = agreed[2 * i]
        if top == SPECIAL:
            special = True
        elif top != ZERO:
            widest = max(widest, i64(top) + i64(agreed[2 * i + 1]) + i64(1))
    return widest, special


@jit
def to_limbs(bits: np.ndarray, low: np.ndarray, limbs: np.ndarray) -> None:
    """``limbs[i]`` = the element's exact value in units of 2**low[i], carried so
    that every limb but the top one is in [0, 2**LIMB_BITS)."""
    words = limbs.shape[1]
    for i in range(bits.shape[1]):
        for j in range(words):
            limbs[i, j] = 0
        for k in range(bits.shape[0]):
            b = bits[k, i]
            if (b << 1) == 0 or low[i] == NONE:     # zero, or a special element
                break
            m, q, msb = split(b)
            negative = b < 0
            s = q - low[i]
            j, o = s // LIMB_BITS, s % LIMB_BITS
            while m:
                piece = (m << o) & mask
                limbs[i, j] += -piece if negative else piece
                m >>= LIMB_BITS - o
                o = 0
                j += 1
        carry = i64(0)
        for j in range(words - 1):
            v = limbs[i, j] + carry
            limbs[i, j] = v & mask
            carry = v >> LIMB_BITS
        limbs[i, words - 1] += carry


@jit
def to_limb_float32(bits: np.ndarray, agreed: np.ndarray, limbs: np.ndarray) -> None:
    """``to_limbs`` of float32 values where every element fits one limb (a zero or
    special element's shift is out of range: 0)."""
    for i in range(bits.size):
        u = bits[i]
        e = i64((u >> 23) & 0xFF)
        m = i64(u & 0x7FFFFF) | (i64(0x800000) if e else i64(0))
        shift = max(e, i64(1)) - 150 + i64(agreed[2 * i + 1])
        v = m << shift if 0 <= shift < LIMB_BITS and e != 0xFF else i64(0)
        limbs[i] = -v if u >> 31 else v


@jit
def rounded(limbs: np.ndarray, low: np.ndarray, precision: int, smallest: int,
            divisor: int, extra: int, out: np.ndarray) -> None:
    """``out[i]`` = the element's total / divisor, rounded once to nearest even at
    ``precision`` bits (subnormals down to 2**smallest)."""
    words = limbs.shape[1]
    n = words + extra
    mag = np.zeros(n, np.int64)
    for i in range(limbs.shape[0]):
        for j in range(extra):
            mag[j] = 0
        carry = i64(0)
        for j in range(words):                  # carried: the top limb's sign is the sum's
            v = limbs[i, j] + carry
            if j < words - 1:
                mag[extra + j] = v & mask
                carry = v >> LIMB_BITS
            else:
                mag[extra + j] = v
        negative = mag[n - 1] < 0
        if negative:                            # the magnitude: -(sum), carried again
            carry = i64(0)
            for j in range(n):
                v = -mag[j] + carry
                if j < n - 1:
                    mag[j] = v & mask
                    carry = v >> LIMB_BITS
                else:
                    mag[j] = v
        sticky = False
        if divisor > 1:                         # long division, top limb first
            r = i64(0)
            for j in range(n - 1, -1, -1):
                cur = (r << LIMB_BITS) + mag[j]
                mag[j] = cur // divisor
                r = cur % divisor
            sticky = r != 0
        top = n - 1
        while top >= 0 and mag[top] == 0:
            top -= 1
        if top < 0:
            out[i] = 0.0
            continue
        base = low[i] - extra * LIMB_BITS       # the exponent of mag's bit 0
        msb = top * LIMB_BITS + top_bit(mag[top])   # mag's top bit
        cut = max(base + msb - (precision - 1), smallest) - base
        if cut <= 0:                            # exact: every bit kept (< 2**53)
            value = i64(0)
            for j in range(top, -1, -1):
                value = (value << LIMB_BITS) | mag[j]
            result = math.ldexp(np.float64(value), base)
        else:
            # bits [cut, msb] (at most 54 of them), the guard bit below, and
            # whether anything lower is set
            j0, o0 = cut // LIMB_BITS, cut % LIMB_BITS
            kept = mag[j0] >> o0
            have = LIMB_BITS - o0
            for j in range(j0 + 1, top + 1):
                kept |= mag[j] << have
                have += LIMB_BITS
            g = cut - 1
            guard = (mag[g // LIMB_BITS] >> (g % LIMB_BITS)) & 1
            sticky = sticky or (mag[g // LIMB_BITS] & ((i64(1) << (g % LIMB_BITS)) - 1)) != 0
            for j in range(g // LIMB_BITS):
                sticky = sticky or mag[j] != 0
            if guard and (sticky or (kept & 1)):
                kept += 1
            result = math.ldexp(np.float64(kept), base + cut)
        out[i] = -result if negative else result


@jit
def rounded_odd(limbs: np.ndarray, agreed: np.ndarray, shift: int, scales: np.ndarray,
                out: np.ndarray) -> None:
    """One limb per element, over 2**shift: the value rounded to odd at 53 bits,
    a float64 that one more rounding to 51 bits or fewer (a cast to float32 or
    float16) rounds as the exact value would round: the integer's float64 (exact
    once rounded to odd) times the power of two of its units, scales[-(lowest
    bit) + shift + SCALE_ZERO] (exact: float32 and float16 units are normal
    float64s)."""
    for i in range(limbs.size):
        v = limbs[i]
        a = abs(v)
        if a >= i64(1 << 53):
            s = top_bit(a) - 52
            a = ((a >> s) | i64((a & ((i64(1) << s) - 1)) != 0)) << s
            v = -a if v < 0 else a
        k = i64(agreed[2 * i + 1]) + shift + SCALE_ZERO
        out[i] = np.float64(v) * scales[max(k, i64(0))]  # zero elements: 0 * anything
                                                         # (a float32 out: cast, once)

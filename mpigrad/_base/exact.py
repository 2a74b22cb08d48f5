"""Exact sums of floating-point values whatever their order or grouping
(Reducer(reproducible=True), ExactSum): the kernels, compiled with numba.

A rank's (or an accumulator's) value of one element is an *expansion*: float64
components whose exact sum it is (float16, bfloat16 and float32 values are
exact in float64; Shewchuk's Grow-Expansion keeps a sum of many values exact
in a few components). Across ranks the elements are summed as integers:

1. each element's top bit (the largest magnitude's) and lowest set bit over
   every rank's components are agreed (an int16 Allreduce of both, by MAX);
2. each rank writes its exact value as a signed integer in units of the
   element's lowest bit, in ``words`` limbs of ``LIMB_BITS`` bits (as many
   as the widest element needs): exact, with no rounding at all;
3. the limbs are summed by an int64 Allreduce (integer sums: exact, and the
   same whatever order the MPI library adds them in);
4. the exact total (divided by the mean's degree, with its remainder kept)
   is rounded once, to nearest even, to each gradient's own dtype.

Plain float32 gradients are read from their bits (exponents_float32,
to_limb_float32: one limb where an element's values across the ranks differ
by less than 2**24 in magnitude), and a one-limb total is rounded to odd at 53
bits, then cast (rounded_odd): the same result as rounding the exact total.

So the result is the correctly rounded sum (or mean) of every addend: the same
bits for the same addends however they are split across ranks, micro-batches,
rank counts, node layouts or MPI libraries, and equal to ``math.fsum`` per
element rounded to the dtype. An exact zero is +0 (as math.fsum gives); an
element with an infinite or NaN addend is the float64 sum of those addends
(inf, -inf or nan; the same on every rank).
"""

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["LIMB_BITS", "MAX_TERMS", "grow", "exponents",
           "exponents_float32", "layout", "to_limbs", "to_limb_float32",
           "real_dtype", "reals", "size_of", "write_results", "round_into"]

#: bits per limb: an int64 limb holds the sum of up to 2**(62 - LIMB_BITS)
#: ranks' limbs, and a remainder times 2**LIMB_BITS below 2**63
LIMB_BITS = 48
#: the most ranks (and the largest mean degree) an exact sum takes
MAX_TERMS = 1 << (62 - LIMB_BITS)
#: the top exponent of an element with a non-finite addend
SPECIAL = 32767
#: the top (and the negated lowest) exponent of an element that is zero
ZERO = -32768
#: the lowest bit of an element that is zero or special
_NONE = 1 << 20

#: per target class: (bits of precision, exponent of the smallest subnormal)
_PRECISION: Dict[np.dtype, Tuple[int, int]] = {}


def _precisions() -> Dict[np.dtype, Tuple[int, int]]:
    if not _PRECISION:
        from .dtypes import bfloat16
        _PRECISION.update({np.dtype(np.float64): (53, -1074), np.dtype(np.float32): (24, -149),
                          np.dtype(np.float16): (11, -24), bfloat16: (8, -133)})
    return _PRECISION


_kernels: Optional[Dict[str, Callable[..., Any]]] = None

#: the index of 2**0 in the table of powers of two rounded_odd scales by
_SCALE_ZERO = 1100
_SCALES: List[np.ndarray] = []


def _scales() -> np.ndarray:
    """2**-(k - _SCALE_ZERO) for k in [0, 2 * _SCALE_ZERO] (within float64's range)."""
    if not _SCALES:
        exponents = np.clip(_SCALE_ZERO - np.arange(2 * _SCALE_ZERO + 1), -1074, 1023)
        _SCALES.append(np.ldexp(1.0, exponents))
    return _SCALES[0]

def _compile() -> Dict[str, Callable[..., Any]]:
    import numba

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
        # Grow-Expansion with zero elimination: out[:, i] = parts[:, i] + x[i]
        # exactly, nonzero components first, increasing in magnitude
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
        # out[2i], out[2i+1] = the top bit, minus the lowest bit, of element i
        for i in range(bits.shape[1]):
            top, low = ZERO, _NONE
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
            out[2 * i + 1] = -low if low != _NONE else ZERO

    @jit
    def exponents_float32(bits: np.ndarray, out: np.ndarray) -> None:
        # exponents() of float32 values (their bits), the lowest bit taken
        # as the mantissa's last: a single value spans 24 bits, one limb
        for i in range(bits.size):
            u = bits[i]
            e = (u >> 23) & 0xFF
            m = u & 0x7FFFFF
            if e == 0xFF:
                top, neglow = i64(SPECIAL), i64(ZERO)
            elif e:
                top, neglow = i64(e) - 127, 150 - i64(e)
            elif m:
                top, neglow = i64(top_bit(i64(m)) - 149), i64(149)
            else:
                top, neglow = i64(ZERO), i64(ZERO)
            out[2 * i] = top
            out[2 * i + 1] = neglow

    @jit
    def layout(agreed: np.ndarray) -> Tuple[Any, bool]:
        # (the widest live element's bits, whether any element is special)
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
        # limbs[i] = the element's exact value in units of 2**low[i], carried
        # so that every limb but the top one is in [0, 2**LIMB_BITS)
        words = limbs.shape[1]
        for i in range(bits.shape[1]):
            for j in range(words):
                limbs[i, j] = 0
            for k in range(bits.shape[0]):
                b = bits[k, i]
                if (b << 1) == 0 or low[i] == _NONE:     # zero, or a special element
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
        # to_limbs() of float32 values where every element fits one limb (a
        # zero or special element's shift is out of range: 0)
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
        # out[i] = the element's total / divisor, rounded once to nearest even
        # at ``precision`` bits (subnormals down to 2**smallest)
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
        # one limb per element, over 2**shift: the value rounded to odd at 53
        # bits, a float64 that one more rounding to 51 bits or fewer (a cast
        # to float32 or float16) rounds as the exact value would round: the
        # integer's float64 (exact once rounded to odd) times the power of two
        # of its units, scales[-(lowest bit) + shift + _SCALE_ZERO] (exact:
        # float32 and float16 units are normal float64s)
        for i in range(limbs.size):
            v = limbs[i]
            a = abs(v)
            if a >= i64(1 << 53):
                s = top_bit(a) - 52
                a = ((a >> s) | i64((a & ((i64(1) << s) - 1)) != 0)) << s
                v = -a if v < 0 else a
            k = i64(agreed[2 * i + 1]) + shift + _SCALE_ZERO
            out[i] = np.float64(v) * scales[max(k, i64(0))]  # zero elements: 0 * anything
                                                             # (a float32 out: cast, once)

    return {"grow": grow, "exponents": exponents, "exponents_float32": exponents_float32,
            "layout": layout, "to_limbs": to_limbs, "to_limb_float32": to_limb_float32,
            "rounded": rounded, "rounded_odd": rounded_odd}


def _kernel(name: str) -> Callable[..., Any]:
    global _kernels
    if _kernels is None:
        _kernels = _compile()
    return _kernels[name]


def grow(parts: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The expansion ``parts`` (components x elements, float64) plus the
    finite float64 values ``x``, exactly: a new expansion, with as many
    components as the widest element needs."""
    out = np.empty((parts.shape[0] + 1, x.size))
    used = _kernel("grow")(parts, x, out)
    return out[:max(used, 1)]


def exponents(parts: np.ndarray, special: np.ndarray) -> np.ndarray:
    """Per element of the expansion ``parts``: its top bit's exponent and its
    lowest bit's, negated, side by side (int16: both agreed by MAX); ZERO
    for both where the element is zero, SPECIAL on top where ``special`` (the
    elements' non-finite addends) is not 0."""
    out = np.empty(2 * parts.shape[1], np.int16)
    _kernel("exponents")(parts.view(np.int64), special, out)
    return out


def exponents_float32(values: np.ndarray) -> np.ndarray:
    """``exponents`` of the 1-D float32 ``values`` (of one addend each),
    straight from their bits."""
    out = np.empty(2 * values.size, np.int16)
    _kernel("exponents_float32")(values.view(np.uint32), out)
    return out


def layout(agreed: np.ndarray) -> Tuple[int, bool]:
    """(words, special) of the agreed exponents: the limbs the widest element
    needs, and whether some element has a non-finite addend (the same on every
    rank)."""
    widest, special = _kernel("layout")(agreed)
    return max(1, -(-int(widest) // LIMB_BITS)), bool(special)


def _lows(agreed: np.ndarray) -> np.ndarray:
    """Each element's lowest bit from the agreed exponents (int32; a sentinel
    where it is zero or special)."""
    top = agreed[0::2]
    low = -agreed[1::2].astype(np.int32)
    low[(top == ZERO) | (top == SPECIAL)] = _NONE
    return low


def to_limbs(parts: np.ndarray, agreed: np.ndarray, words: int) -> np.ndarray:
    """The exact values of ``parts``' elements as integers in units of their
    agreed lowest bit, in ``words`` limbs each (elements x words, int64; the
    least significant first)."""
    limbs = np.empty((parts.shape[1], words), np.int64)
    _kernel("to_limbs")(parts.view(np.int64), _lows(agreed), limbs)
    return limbs


def to_limb_float32(values: np.ndarray, agreed: np.ndarray) -> np.ndarray:
    """``to_limbs`` of the 1-D float32 ``values`` where ``layout`` gives one word."""
    limbs = np.empty((values.size, 1), np.int64)
    _kernel("to_limb_float32")(values.view(np.uint32), agreed, limbs.reshape(-1))
    return limbs


#: the dtypes a float64 rounded to odd at 53 bits casts to correctly (2 bits or more fewer)
_NARROW = (np.dtype(np.float32), np.dtype(np.float16))


def round_into(out: np.ndarray, limbs: np.ndarray, agreed: np.ndarray, divisor: int) -> None:
    """The summed ``limbs`` (units of each element's agreed lowest bit) divided
    by ``divisor``, rounded once to nearest even to the dtype of ``out`` (1-D,
    float16, bfloat16, float32 or float64), written there."""
    dtype = out.dtype
    shift = divisor.bit_length() - 1
    if divisor != 1 << shift:
        shift = 0                              # long division, below
    elif limbs.shape[1] == 1 and dtype in _NARROW:
        staged = out if dtype == np.float32 else np.empty(out.size)
        _kernel("rounded_odd")(limbs.reshape(-1), agreed, shift, _scales(), staged)
        if staged is not out:
            with np.errstate(over="ignore"):   # past the dtype's range: inf, as rounded
                out[...] = staged
        return
    precision, smallest = _precisions()[dtype]
    extra = 0 if divisor == 1 << shift else 2  # room below the units for the quotient's bits
    exact = np.empty(out.size)                 # values the dtype holds exactly
    _kernel("rounded")(limbs, _lows(agreed) - shift, precision, smallest, divisor >> shift,
                       extra, exact)
    with np.errstate(over="ignore"):           # past the dtype's range: inf, as rounded
        out[...] = exact


Layout = Sequence[Tuple[Tuple[int, ...], np.dtype]]


def real_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype of ``dtype``'s real part (itself unless complex)."""
    return np.dtype(f"f{dtype.itemsize // 2}") if dtype.kind == "c" else dtype


def reals(array: np.ndarray) -> np.ndarray:
    """The C-contiguous ``array``'s elements as a 1-D view, complex ones as
    (real, imaginary) pairs: the order of an exact sum's elements."""
    flat = array.reshape(-1)
    return flat.view(real_dtype(flat.dtype))


def size_of(shapes: Layout) -> int:
    """The real elements of arrays of ``shapes`` ((shape, dtype) pairs)."""
    return sum(int(np.prod(shape)) * (2 if dtype.kind == "c" else 1) for shape, dtype in shapes)


def write_results(outs: Sequence[np.ndarray], limbs: np.ndarray, agreed: np.ndarray,
                  special: Optional[np.ndarray], divisor: int) -> None:
    """The totals in ``limbs`` (units of the agreed lowest bits; ``special``:
    the non-finite addends' sums, which win where not 0, or None where there
    are none) divided by ``divisor`` and rounded once into ``outs``, element
    after element (C order; complex ones as real, imaginary pairs)."""
    start = 0
    for array in outs:
        staged = not array.flags.c_contiguous
        into = np.empty(array.shape, array.dtype) if staged else array
        values = reals(into)
        piece = slice(start, start + values.size)
        round_into(values, limbs[piece], agreed[2 * piece.start:2 * piece.stop], divisor)
        if special is not None:
            odd = special[piece] != 0
            values[odd] = special[piece][odd] / divisor
        if staged:
            array[...] = into
        start = piece.stop

"""Exact sums of floating-point values whatever their order or grouping
(Reducer(reproducible=True), ExactSum): the kernels, compiled with numba, and
for plain float32 values in C (native.py: the same bits, a vector pass each).

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

Plain float32 gradients are read from their bits and agree one pair of
exponents per block of elements, not per element (exponents_float32 with a
block, split_blocks): a block whose values across the ranks span at most a
limb's bits takes its pair for every element, one limb each (to_limb_float32),
so nothing per element travels but the limb; the elements of the rare wider
blocks (a value far smaller than its neighbours', or not finite) are summed
apart, per element as above. A one-limb total is rounded to odd at 53 bits,
then cast (rounded_odd): the same result as rounding the exact total.

On one node that holds every rank, float32, float16 and bfloat16 values skip
the limbs (sum_in_one_pass): the rank that sums an element reads every
rank's addend of it, and a run of them that fits one limb has an exact
float64 sum, whose quotient rounds once to the same bits; the rare other
runs are summed element by element by that rank.

So the result is the correctly rounded sum (or mean) of every addend: the same
bits for the same addends however they are split across ranks, micro-batches,
rank counts, node layouts or MPI libraries, and equal to ``math.fsum`` per
element rounded to the dtype. An exact zero is +0 (as math.fsum gives); an
element with an infinite or NaN addend is the float64 sum of those addends
(inf, -inf or nan; the same on every rank).
"""

import ctypes
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import native
from .address import address
from .bfloat16 import is_bfloat16
from .dtypes import assign
from .exact_units import LIMB_BITS, MAX_TERMS, NONE, SCALE_ZERO, SPECIAL, ZERO

__all__ = ["FLOAT64_TERMS", "LIMB_BITS", "MAX_TERMS", "grow", "exponents",
           "exponents_float32", "split_blocks", "split_special", "layout", "to_limbs",
           "to_limb_float32", "sum_in_one_pass", "sums_in_one_pass", "gradual_underflow",
           "real_dtype", "reals", "size_of", "write_results", "write_float32", "round_into"]

#: the most addends whose float64 sum is exact where their block fits one limb
FLOAT64_TERMS = 1 << (53 - LIMB_BITS)

#: per target class, by name (no ml_dtypes import for bfloat16's): (bits of precision,
#: exponent of the smallest subnormal)
_PRECISION: Dict[str, Tuple[int, int]] = {"float64": (53, -1074), "float32": (24, -149),
                                          "float16": (11, -24), "bfloat16": (8, -133)}


_SCALES: List[np.ndarray] = []


def _scales() -> np.ndarray:
    """2**-(k - SCALE_ZERO) for k in [0, 2 * SCALE_ZERO] (within float64's range)."""
    if not _SCALES:
        exponents = np.clip(SCALE_ZERO - np.arange(2 * SCALE_ZERO + 1), -1074, 1023)
        _SCALES.append(np.ldexp(1.0, exponents))
    return _SCALES[0]


def _kernels() -> Any:
    """The compiled kernels (mpigrad._base.exact_kernels: numba is imported on first use)."""
    from . import exact_kernels
    return exact_kernels


def grow(parts: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The expansion ``parts`` (components x elements, float64) plus the
    finite float64 values ``x``, exactly: a new expansion, with as many
    components as the widest element needs."""
    out = np.empty((parts.shape[0] + 1, x.size))
    used = _kernels().grow(parts, x, out)
    return out[:max(used, 1)]


def exponents(parts: np.ndarray, special: np.ndarray) -> np.ndarray:
    """Per element of the expansion ``parts``: its top bit's exponent and its
    lowest bit's, negated, side by side (int16: both agreed by MAX); ZERO
    for both where the element is zero, SPECIAL on top where ``special`` (the
    elements' non-finite addends) is not 0."""
    out = np.empty(2 * parts.shape[1], np.int16)
    _kernels().exponents(parts.view(np.int64), special, out)
    return out


def exponents_float32(values: np.ndarray, block: int = 1) -> np.ndarray:
    """``exponents`` of the 1-D float32 ``values`` (of one addend each),
    straight from their bits: one pair per block of at most ``block`` values
    (1: per element), the maxima of its values' top bits and of their lowest
    bits, negated (the mantissa's last: one value spans 24 bits; a subnormal
    counts in 2**-126's binade, which only narrows what fits one limb). The
    blocks are strided: block b holds the elements b, b + n, b + 2n, ... for
    n = ceil(size / block) blocks, so that each pass is a vector one over whole
    rows."""
    count = -(-values.size // block)
    c = native.library()
    if c is not None and values.flags.c_contiguous:
        pairs = np.empty(2 * count, np.int16)
        c.exact_exponents_f32(values.ctypes.data, values.size, count, pairs.ctypes.data)
        return pairs
    rows = [slice(k * count, (k + 1) * count) for k in range(block)]
    magnitude = values.view(np.uint32) & np.uint32(0x7FFFFFFF)
    high = np.zeros(count, np.uint32)
    for row in rows:
        part = magnitude[row]
        np.maximum(high[:part.size], part, out=high[:part.size])
    magnitude -= np.uint32(1)                  # zeros wrap past every nonzero value
    low = np.full(count, 0xFFFFFFFF, np.uint32)
    for row in rows:
        part = magnitude[row]
        np.minimum(low[:part.size], part, out=low[:part.size])
    out = np.empty((count, 2), np.int16)
    binade = (high >> 23).astype(np.int16)
    out[:, 0] = np.maximum(binade, 1) - 127
    out[:, 1] = 150 - np.maximum(((low + np.uint32(1)) >> 23).astype(np.int16), 1)
    out[high == 0] = ZERO
    out[binade == 0xFF] = (SPECIAL, ZERO)
    return out.reshape(-1)


def split_blocks(blocks: np.ndarray, block: int, size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(pairs, apart) from the agreed pairs ``blocks`` of ``size`` float32
    elements in strided blocks of ``block`` (``exponents_float32``): each
    block's pair where it fits one limb, ZERO where it does not (wider than a
    limb, or with a non-finite value: its limbs 0); and the (sorted) elements
    of those blocks, to be summed apart, per element."""
    pairs = blocks.reshape(-1, 2)
    top = pairs[:, 0].astype(np.int32)
    wide = (top == SPECIAL) | ((top != ZERO) & (top + pairs[:, 1] + 1 > LIMB_BITS))
    if wide.any():
        pairs = pairs.copy()
        pairs[wide] = ZERO
    apart = (np.arange(block)[:, None] * len(pairs) + np.flatnonzero(wide)).reshape(-1)
    return pairs.reshape(-1), apart[apart < size]


def _per_element(pairs: np.ndarray, size: int) -> np.ndarray:
    """Every element's pair from its strided block's (``split_blocks``)."""
    count = pairs.size // 2
    return pairs if count == size else np.tile(pairs, -(-size // count))[:2 * size]


def layout(agreed: np.ndarray) -> Tuple[int, bool]:
    """(words, special) of the agreed exponents: the limbs the widest element
    needs, and whether some element has a non-finite addend (the same on every
    rank)."""
    widest, special = _kernels().layout(agreed)
    return max(1, -(-int(widest) // LIMB_BITS)), bool(special)


def _lows(agreed: np.ndarray) -> np.ndarray:
    """Each element's lowest bit from the agreed exponents (int32; a sentinel
    where it is zero or special)."""
    top = agreed[0::2]
    low = -agreed[1::2].astype(np.int32)
    low[(top == ZERO) | (top == SPECIAL)] = NONE
    return low


def to_limbs(parts: np.ndarray, agreed: np.ndarray, words: int) -> np.ndarray:
    """The exact values of ``parts``' elements as integers in units of their
    agreed lowest bit, in ``words`` limbs each (elements x words, int64; the
    least significant first)."""
    limbs = np.empty((parts.shape[1], words), np.int64)
    _kernels().to_limbs(parts.view(np.int64), _lows(agreed), limbs)
    return limbs


def to_limb_float32(values: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """``to_limbs`` of the 1-D float32 ``values`` where ``layout`` gives one
    word; ``pairs``: every element's agreed pair, or its strided block's
    (``split_blocks``)."""
    limbs = np.empty((values.size, 1), np.int64)
    c = native.library()
    if c is not None and values.flags.c_contiguous:
        c.exact_limbs_f32(values.ctypes.data, values.size, pairs.size // 2,
                          pairs.ctypes.data, limbs.ctypes.data)
    else:
        _kernels().to_limb_float32(values.view(np.uint32), _per_element(pairs, values.size),
                                   limbs.reshape(-1))
    return limbs


def write_float32(outs: Sequence[np.ndarray], limbs: np.ndarray, pairs: np.ndarray,
                  divisor: int) -> None:
    """``write_results`` of one-limb totals of float32 values (float32 sums,
    or half-precision addends' exact float32 casts) into the 1-D ``outs``
    (taken end to end: float32, float16 or bfloat16), ``pairs`` their
    strided blocks' agreed pairs. A half-precision result is rounded to odd
    at float32's 24 bits, then to nearest: the exact value's one rounding. In
    C, a divisor that is not a power of two divides in float64 (exact enough:
    kernels.c) wherever the totals are below 2**53; else the long division."""
    if not _rounded_in_c(outs, limbs, pairs, divisor):
        write_results(outs, limbs, _per_element(pairs, limbs.shape[0]), None, divisor)


def _rounded_in_c(outs: Sequence[np.ndarray], limbs: np.ndarray, pairs: np.ndarray,
                  divisor: int) -> bool:
    """``write_float32`` in C; False where it cannot be had (no C kernels, or a
    total of 2**53 units or more with a divisor not a power of two)."""
    c = native.library()
    if c is None:
        return False
    first, flat, scales = 0, limbs.reshape(-1), _scales()
    for out in outs:
        half = out.dtype != np.float32
        staged = np.empty(out.size, np.float32) if half else out
        if not c.exact_round_odd_f32(flat[first:].ctypes.data, first, out.size,
                                     pairs.size // 2, pairs.ctypes.data, divisor,
                                     scales.ctypes.data, int(half), staged.ctypes.data):
            return False
        if half:
            with np.errstate(over="ignore"):   # past the dtype's range: inf, as rounded
                assign(out, staged)
        first += out.size
    return True


def sums_in_one_pass(terms: int) -> bool:
    """Whether ``sum_in_one_pass`` sums ``terms`` addends here: the C kernels
    are built and ``terms`` is at most FLOAT64_TERMS."""
    return native.library() is not None and terms <= FLOAT64_TERMS


def sum_in_one_pass(out: np.ndarray, addends: Sequence[np.ndarray], divisor: int) -> None:
    """``out`` = the exact sum of the ``addends`` (1-D, C-contiguous, of
    ``out``'s size and dtype: float32, float16 or bfloat16; ``out`` may be one
    of them) divided by ``divisor``, rounded once (half precision: to odd at
    float32, then to nearest), in one pass of the C kernels over runs of 32
    elements: a run whose values (exact in float32) fit one limb has every
    partial sum a multiple of its lowest bit below 2**53 of them, so its
    float64 sum is exact, and the float64 quotient is never a float32 value
    (nor a tie) unless the exact one is (kernels.c); the other runs (a wider
    span, an infinity, a NaN) are then summed element by element, all of them
    in one ``_sum_apart``: the same bits as the limbs' path across the ranks.
    Only where ``sums_in_one_pass``."""
    c = native.library()
    assert c is not None and sums_in_one_pass(len(addends))
    sources = (ctypes.c_void_p * len(addends))(*[address(a) for a in addends])
    apart = np.empty(-(-out.size // _RUN), np.int64)
    if out.dtype == np.float32:
        count = c.exact_sum_f32(sources, len(addends), out.size, divisor, address(out),
                                apart.ctypes.data)
    else:
        count = c.exact_sum_half(sources, len(addends), out.size, divisor,
                                 int(is_bfloat16(out.dtype)), address(out), apart.ctypes.data)
    if count:               # every such run's elements at once (a wide span may be common)
        at = (apart[:count, None] + np.arange(_RUN)).reshape(-1)
        at = at[at < out.size]                    # (the last run may be short)
        summed = np.empty(at.size, out.dtype)
        with gradual_underflow():
            _sum_apart(summed, [a[at] for a in addends], divisor)
        out[at] = summed


#: the elements the one-pass kernels check at a time (kernels.c: EXACT_RUN)
_RUN = 32


@contextmanager
def gradual_underflow() -> Iterator[None]:
    """Inside, the calling thread neither reads denormals as zero nor flushes
    them to zero (torch.set_flush_denormal sets both), so that numpy's and the
    numba kernels' exact arithmetic holds; its mode restored after (as it is,
    without the C kernels)."""
    c = native.library()
    mode = None if c is None else c.exact_mode_enter()
    try:
        yield
    finally:
        if c is not None:
            c.exact_mode_leave(mode)


def _sum_apart(out: np.ndarray, addends: Sequence[np.ndarray], divisor: int) -> None:
    """``out`` = the exact sum of the ``addends`` (1-D, ``out``'s size, exact
    in float64; ``out`` may be one of them) divided by ``divisor``, rounded
    once, element by element: the ranks' per-element method (exponents agreed,
    limbs summed, rounded) over addends held by one process; an element with
    an infinite or NaN addend is their float64 sum, in order (inside
    ``gradual_underflow``: its float64 casts read subnormals)."""
    parts, specials = zip(*(split_special(a.astype(np.float64)) for a in addends))
    agreed = np.max([exponents(p[None, :], s) for p, s in zip(parts, specials)], axis=0)
    words, odd = layout(agreed)
    limbs = to_limbs(parts[0][None, :], agreed, words)
    for more_parts in parts[1:]:
        limbs += to_limbs(more_parts[None, :], agreed, words)
    special = specials[0].copy()
    with np.errstate(invalid="ignore"):      # inf - inf: nan, as the ranks' sum gives it
        for more in specials[1:]:
            special += more
    write_results([out], limbs, agreed, special if odd else None, divisor)


def split_special(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(finite, special): ``values`` with its infinities and NaNs set to 0,
    and those alone (0 elsewhere); ``values`` is overwritten."""
    bad = ~np.isfinite(values)
    special = np.where(bad, values, 0.0)
    values[bad] = 0.0
    return values, special


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
        _kernels().rounded_odd(limbs.reshape(-1), agreed, shift, _scales(), staged)
        if staged is not out:
            with np.errstate(over="ignore"):   # past the dtype's range: inf, as rounded
                out[...] = staged
        return
    precision, smallest = _PRECISION[dtype.name]
    extra = 0 if divisor == 1 << shift else 2  # room below the units for the quotient's bits
    exact = np.empty(out.size)                 # values the dtype holds exactly
    _kernels().rounded(limbs, _lows(agreed) - shift, precision, smallest, divisor >> shift,
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

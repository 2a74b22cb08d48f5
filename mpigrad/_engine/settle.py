"""The last pass over reduced memory: the mean's scale and the finite check.

Both run once per call over memory reduced in place, after every bucket's
Allreduce: scaling each piece as soon as its Allreduce returned costs several
times more (the peer's core has just written those lines; docs/performance.md).
With the finite check on, scale and check are one compiled pass (numba)
instead of numpy's three (multiply, max, min).
"""

import bisect
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._backends import Ranges
from .._base.dtypes import wire_dtype

__all__ = ["scale_dtype", "mean_factor", "rescaled", "scale", "all_finite", "settle", "Settle"]

_COMPILED_MIN = 1 << 16      # elements; below this numpy's passes cost less than a call
_kernels: Optional[Tuple[Callable[..., bool], Callable[..., bool]]] = None


def _compile() -> Tuple[Callable[..., bool], Callable[..., bool]]:
    import numba

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def scale_check(a: np.ndarray, factor: Any, limit: float) -> bool:
        bad = False
        for i in range(a.size):
            y = a[i] * factor
            a[i] = y
            bad |= not abs(y) < limit            # nan compares false: not finite
        return not bad

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def check(a: np.ndarray, limit: float) -> bool:
        bad = False
        for i in range(a.size):
            bad |= not abs(a[i]) < limit
        return not bad

    return scale_check, check


def _real(array: np.ndarray) -> np.ndarray:
    """A real view of a contiguous array: complex values part by part."""
    return array.view(np.finfo(array.dtype).dtype) if array.dtype.kind == "c" else array


@functools.lru_cache(maxsize=256)       # (a small call's every mean asks: 0.7 µs -> 0.1)
def scale_dtype(dtype: Any) -> np.dtype:
    """The real dtype values of ``dtype`` are scaled in: float64 for integers
    and bools, float32 for half precision (its wire dtype), else the dtype's
    own real precision."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iub":
        return np.dtype(np.float64)
    return np.finfo(wire_dtype(dtype)).dtype


@functools.lru_cache(maxsize=256)
def mean_factor(dtype: Any, divisor: int) -> Optional[np.floating[Any]]:
    """The mean's factor for values of ``dtype`` over ``divisor`` ranks, in
    ``scale_dtype``; None for a sum (a divisor of 1). The one place the mean
    is decided: reductions, sparse gathers, node sums and metrics all scale
    by it (with ``scale``/``settle``)."""
    if divisor == 1:
        return None
    factor: np.floating[Any] = scale_dtype(dtype).type(1.0 / divisor)
    return factor


def rescaled(values: np.ndarray, factor: float = 1.0, divisor: int = 1,
             integer: bool = False) -> np.ndarray:
    """``values`` times ``factor``, or divided by ``divisor`` (correctly
    rounded), computed in their ``scale_dtype`` (Horovod's pre- and
    post-scaling, an integer mean); with ``integer``, rounded toward zero
    for an integer result, as torch's casts and Horovod's average.
    ``values`` themselves where there is nothing to do."""
    if factor == 1.0 and divisor == 1:
        return values
    math = scale_dtype(values.dtype)
    out: np.ndarray = values.astype(math)
    out = out / math.type(divisor) if divisor != 1 else out * math.type(factor)
    return np.trunc(out) if integer else out


def scale(array: np.ndarray, factor: Any) -> None:
    """Multiply the contiguous ``array`` by the real ``factor`` in place; a
    complex array part by part (numpy would multiply by factor+0j, and
    (inf+1j) * (1/3+0j) is inf+nanj, where the mean of inf+1j is inf+(1/3)j)."""
    array = _real(array)
    array *= factor


def all_finite(array: np.ndarray, limit: float = np.inf) -> bool:
    """Whether every value of ``array`` (real and imaginary parts alike) is
    finite and below ``limit`` in magnitude."""
    return bool(settle(array.reshape(-1), None, limit))


def settle(flat: np.ndarray, factor: Any = None, limit: Optional[float] = None
           ) -> Optional[bool]:
    """Multiply the 1-D contiguous ``flat`` by ``factor`` in place (None: leave
    it) and, with a ``limit``, return whether every resulting value is finite
    and below it in magnitude (None without one)."""
    flat = _real(flat)
    if limit is None:
        if factor is not None:
            flat *= factor
        return None
    if flat.size == 0:
        return True
    if flat.size < _COMPILED_MIN:
        if factor is not None:
            flat *= factor
        return bool(flat.max() < limit and flat.min() > -limit)
    global _kernels
    if _kernels is None:
        _kernels = _compile()
    scale_check, check = _kernels
    if factor is None:
        return check(flat, float(limit))
    return scale_check(flat, flat.dtype.type(factor), float(limit))


#: (start, stop, limit): an arena's finite-check limits by range
Limits = List[Tuple[int, int, float]]


class _Checks:
    """An arena's finite-check limits by range: [(start, stop, limit)] back
    to back, covering it (neighbours of one limit are checked as one)."""

    def __init__(self, ranges: Limits) -> None:
        self.ranges: Limits = []
        for start, stop, limit in ranges:
            if self.ranges and self.ranges[-1][2] == limit and self.ranges[-1][1] == start:
                self.ranges[-1] = (self.ranges[-1][0], stop, limit)
            else:
                self.ranges.append((start, stop, limit))
        self.stops = [stop for _, stop, _ in self.ranges]

    def within(self, lo: int, hi: int) -> Limits:
        """The (start, stop, limit) of the ranges that overlap [lo, hi), clipped to it."""
        found = []
        for start, stop, limit in self.ranges[bisect.bisect_right(self.stops, lo):]:
            if start >= hi:
                break
            found.append((max(start, lo), min(stop, hi), limit))
        return found


class Settle:
    """One call's settle step: the mean (a real factor per wire dtype) and,
    with ``check_finite``, the finite flag of everything it settles.

    Backends call ``bucket`` (a whole reduced bucket) or ``piece`` (a piece
    of a wire dtype's arena, as the node sum does while it is in cache).

    Args:
        dtypes: each bucket's wire dtype.
        starts: each bucket's first element in its dtype's arena.
        sizes: each bucket's elements.
        limits: each bucket's finite limit (``dtypes.finite_limit``), or None
            when the check is off.
        divisor: the mean's divisor (1: a sum).
    """

    def __init__(self, dtypes: Sequence[np.dtype], starts: Sequence[int], sizes: Sequence[int],
                 limits: Optional[Sequence[float]], divisor: int) -> None:
        self.dtypes = dtypes
        self.starts = starts
        self.limits = limits
        self.factors = {d: mean_factor(d, divisor) for d in set(dtypes)}
        self.finite: Optional[bool] = None if limits is None else True
        self._checks: Dict[np.dtype, _Checks] = {}
        if limits is not None:
            ranges: Dict[np.dtype, Limits] = {}
            for dtype, start, size, limit in zip(dtypes, starts, sizes, limits):
                ranges.setdefault(dtype, []).append((start, start + size, limit))
            self._checks = {d: _Checks(r) for d, r in ranges.items()}

    def note(self, finite: Optional[bool]) -> None:
        """Fold one check's result (None: not checked) into the call's flag."""
        if finite is not None and self.finite is not None:
            self.finite = self.finite and finite

    def ranges(self, dtype: np.dtype, lo: int, hi: int) -> Ranges:
        """[lo, hi) of the ``dtype`` arena cut where its finite limit changes:
        (lo, hi, the mean's factor or None for a sum, the limit or None unchecked),
        for a kernel that settles as it sums (its flag goes to ``note``)."""
        factor = self.factors[dtype]
        scale = None if factor is None else float(factor)
        if self.limits is None:
            return [(lo, hi, scale, None)]
        return [(a, b, scale, limit) for a, b, limit in self._checks[dtype].within(lo, hi)]

    def part_ranges(self, i: int, lo: int, hi: int) -> Ranges:
        """``ranges`` of [lo, hi) of bucket ``i``, in the bucket's positions."""
        start = self.starts[i]
        return [(a - start, b - start, scale, limit)
                for a, b, scale, limit in self.ranges(self.dtypes[i], start + lo, start + hi)]

    def bucket(self, i: int, flat: np.ndarray) -> None:
        """Settle bucket ``i``'s reduced 1-D memory ``flat``."""
        limit = None if self.limits is None else self.limits[i]
        self.note(settle(flat, self.factors[self.dtypes[i]], limit))

    def piece(self, dtype: np.dtype, offset: int, flat: np.ndarray) -> None:
        """Settle ``flat``, the reduced [offset, offset + flat.size) of the
        ``dtype`` arena, in one pass per range of one finite limit."""
        factor = self.factors[dtype]
        for lo, hi, _, limit in self.ranges(dtype, offset, offset + flat.size):
            self.note(settle(flat[lo - offset:hi - offset], factor, limit))

    def part(self, i: int, lo: int, flat: np.ndarray) -> None:
        """Settle ``flat``, the reduced [lo, lo + flat.size) of bucket ``i``."""
        self.piece(self.dtypes[i], self.starts[i] + lo, flat)

    def agree(self, combine: Callable[[bool], bool]) -> None:
        """Replace the finite flag by ``combine(flag)`` (a backend whose ranks
        each checked a part: their flags agreed over all ranks)."""
        if self.finite is not None:
            self.finite = combine(self.finite)

"""Adasum, Horovod's adaptive summation (op=hvd.Adasum), on CPU.

Two gradients combine as

    Adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 where its norm^2 is below 1e-8, as in Horovod), tensor by
tensor, and the ranks' gradients combine as a binary tree:
Adasum(Adasum(g0, g1), Adasum(g2, g3)), ... which needs a power-of-two
number of ranks. The tree runs as Horovod runs it, vector halving and
distance doubling: at distance d = 1, 2, 4, ... each rank trades half of its
piece with rank ^ d, the dot products of the halves are summed over the
2d ranks that hold the two blocks' pieces (recursive doubling), and each
rank combines its half; the pieces are gathered at the end. Arithmetic is in
float64.
"""

from typing import List, Sequence, Tuple

import numpy as np

from .._collective import Collective, Kind, MatchingGroup

__all__ = ["NORM_FLOOR", "combine", "coefficients", "adasum"]

#: below this squared norm a gradient's coefficient is 1 (Horovod's guard)
NORM_FLOOR = 1e-8


def coefficients(dots: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(a's, b's) coefficients from rows of (a.b, |a|^2, |b|^2)."""
    dot, aa, bb = dots[:, 0], dots[:, 1], dots[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        ca = np.where(aa >= NORM_FLOOR, 1.0 - dot / (2.0 * aa), 1.0)
        cb = np.where(bb >= NORM_FLOOR, 1.0 - dot / (2.0 * bb), 1.0)
    return ca, cb


def combine(a: np.ndarray, b: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """Adasum of two whole flat vectors of tensors of ``sizes`` (serially)."""
    bounds = np.cumsum([0, *sizes])
    dots = _dots(a, b, (0, a.size), bounds)
    return _combined(a, b, (0, a.size), bounds, *coefficients(dots))


def _overlaps(piece: Tuple[int, int], bounds: np.ndarray) -> List[Tuple[int, int, int]]:
    """(tensor, start, stop) of each tensor's part in ``piece``, relative to it."""
    lo, hi = piece
    parts = []
    for t in range(len(bounds) - 1):
        start, stop = max(lo, int(bounds[t])), min(hi, int(bounds[t + 1]))
        if start < stop:
            parts.append((t, start - lo, stop - lo))
    return parts


def _dots(a: np.ndarray, b: np.ndarray, piece: Tuple[int, int],
          bounds: np.ndarray) -> np.ndarray:
    """Each tensor's (a.b, |a|^2, |b|^2) over ``piece`` (zeros elsewhere)."""
    dots = np.zeros((len(bounds) - 1, 3))
    for t, start, stop in _overlaps(piece, bounds):
        x, y = a[start:stop], b[start:stop]
        dots[t] = (x @ y, x @ x, y @ y)
    return dots


def _combined(a: np.ndarray, b: np.ndarray, piece: Tuple[int, int], bounds: np.ndarray,
              ca: np.ndarray, cb: np.ndarray) -> np.ndarray:
    out = np.empty_like(a)
    for t, start, stop in _overlaps(piece, bounds):
        out[start:stop] = ca[t] * a[start:stop] + cb[t] * b[start:stop]
    return out


def _pieces(size: int, ranks: int) -> List[Tuple[int, int]]:
    """Each rank's piece of a vector of ``size`` after the halvings."""
    pieces = []
    for rank in range(ranks):
        lo, hi, d = 0, size, 1
        while d < ranks:
            mid = lo + (hi - lo) // 2
            lo, hi = (lo, mid) if not rank & d else (mid, hi)
            d <<= 1
        pieces.append((lo, hi))
    return pieces


def adasum(group: MatchingGroup, flat: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """The Adasum of every rank's ``flat`` (float64, tensors of ``sizes``
    back to back) over ``group`` (a power-of-two number of ranks), on every rank."""
    ranks, rank = group.size, group.rank
    group.open_point_to_point()
    bounds = np.cumsum([0, *sizes])
    lo, hi, mine, d = 0, flat.size, flat, 1
    while d < ranks:
        mid, lower, partner = lo + (hi - lo) // 2, not rank & d, rank ^ d
        keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
        theirs = np.empty(keep[1] - keep[0])
        group.exchange(np.ascontiguousarray(mine[give[0] - lo:give[1] - lo]), theirs, partner,
                       f"Adasum: halves traded with rank {partner}")
        kept = mine[keep[0] - lo:keep[1] - lo]
        a, b = (kept, theirs) if lower else (theirs, kept)
        dots = _dots(a, b, keep, bounds)
        j = 1
        while j <= d:                       # summed over the 2d ranks of the two blocks
            other = np.empty_like(dots)
            group.exchange(dots, other, rank ^ j, "Adasum: dot products summed")
            dots = dots + other if not rank & j else other + dots
            j <<= 1
        mine = _combined(a, b, keep, bounds, *coefficients(dots))
        (lo, hi), d = keep, d << 1
    pieces = _pieces(flat.size, ranks)
    (gathered,), _ = group.start(Collective(Kind.ALLGATHER, "Adasum's pieces",
                                            (np.ascontiguousarray(mine),))).complete()
    out = np.empty_like(flat)
    offset = 0
    for start, stop in pieces:
        out[start:stop] = gathered[offset:offset + stop - start]
        offset += stop - start
    return out

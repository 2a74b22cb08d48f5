"""Shards of the fused gradient space: which elements each rank owns (pure).

A plan's wire-dtype space is, for each wire dtype, its buckets back to back
in plan order (the bucket buffers' arenas). Rank r of p owns the balanced,
contiguous range [n r / p, n (r + 1) / p) of each wire dtype's n elements:
whole gradients and pieces of them, in that order.
"""

import math
from typing import Dict, List, Tuple

import numpy as np

from .._base.ranges import shard_range
from .buffers import arena_sizes, arena_starts
from .plan import FusionPlan

__all__ = ["owned", "wire_dtypes"]


def owned(plan: FusionPlan, rank: int, size: int) -> Dict[np.dtype, List[Tuple[int, int, int]]]:
    """{wire dtype: [(gradient position, first, stop)]}: the flat element
    ranges of the gradients that ``rank`` owns, in its shard's order."""
    ranges = {d: shard_range(n, rank, size) for d, n in arena_sizes(plan.buckets).items()}
    out: Dict[np.dtype, List[Tuple[int, int, int]]] = {d: [] for d in ranges}
    for bucket, start in zip(plan.buckets, arena_starts(plan.buckets)):
        lo, hi = ranges[bucket.dtype]
        for index, offset, shape in zip(bucket.indices, bucket.offsets, bucket.shapes):
            begin = start + offset
            first, stop = max(lo, begin), min(hi, begin + math.prod(shape))
            if first < stop:
                out[bucket.dtype].append((index, first - begin, stop - begin))
    return out


def wire_dtypes(plan: FusionPlan) -> Dict[int, np.dtype]:
    """{gradient position: its wire dtype} of every dense gradient of ``plan``."""
    return {index: bucket.dtype for bucket in plan.buckets for index in bucket.indices}

"""The one shard boundary: which of ``n`` elements each of ``size`` ranks owns
(reduce-scatter shards, the node sums' slices)."""

from typing import Tuple

__all__ = ["shard_range"]


def shard_range(n: int, rank: int, size: int) -> Tuple[int, int]:
    """[first, stop) of the ``n`` elements that ``rank`` of ``size`` owns: a
    balanced, contiguous range, [n rank / size, n (rank + 1) / size)."""
    return n * rank // size, n * (rank + 1) // size

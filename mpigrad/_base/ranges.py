"""The one shard boundary: which of ``n`` elements each of ``size`` ranks owns
(reduce-scatter shards, the node sums' slices); and the one cut of a buffer
into messages (``pieces``)."""

from typing import Iterator, Tuple

__all__ = ["shard_range", "pieces"]


def shard_range(n: int, rank: int, size: int) -> Tuple[int, int]:
    """[first, stop) of the ``n`` elements that ``rank`` of ``size`` owns: a
    balanced, contiguous range, [n rank / size, n (rank + 1) / size)."""
    return n * rank // size, n * (rank + 1) // size


def pieces(n: int, itemsize: int, chunk_bytes: int) -> Iterator[Tuple[int, int]]:
    """[lo, hi) of the consecutive pieces of ``n`` elements of ``itemsize``
    bytes, each at most ``chunk_bytes`` (at least one element)."""
    step = max(1, chunk_bytes // itemsize)
    return ((lo, min(lo + step, n)) for lo in range(0, n, step))

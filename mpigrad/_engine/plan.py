"""Pure fusion planner: gradient specs in, an immutable FusionPlan out.

No MPI and no GPU here: the plan depends only on the shapes, dtypes and kinds
of the gradients, the split indices and the bucket cap, so it is computed once
per gradient signature and cached by the reducer.
"""

import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._base.arena import Slot
from .._base.dtypes import wire_dtype
from .._base.validate import check_bucket_bytes, check_split_indices

__all__ = ["DENSE", "SPARSE", "SKIP", "DEFAULT_BUCKET_BYTES", "GradSpec", "Bucket",
           "SparseGroup", "FusionPlan", "make_plan"]

DENSE, SPARSE, SKIP = "dense", "sparse", "skip"

Shape = Tuple[int, ...]

#: Default bucket cap when no split indices are given: 1 MiB, the fastest for
#: in-place reduction of ResNet-50 in ``mpigrad-bench --sweep bucket``
#: (docs/performance.md), because every gradient of 1 MiB or more then gets
#: a bucket of its own and is reduced in its own memory, with no copy, while
#: the small ones are still fused.
DEFAULT_BUCKET_BYTES = 1 << 20


@dataclass(frozen=True)
class GradSpec:
    """What the planner needs of one gradient."""

    kind: str            # DENSE, SPARSE or SKIP
    shape: Shape         # dense shape (dense_shape for a sparse gradient)
    dtype: Optional[np.dtype]   # gradient dtype (values dtype for a sparse
                                # gradient; None for a skipped one)
    index_dtype: Optional[np.dtype] = None   # a sparse gradient's index dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    """A contiguous wire buffer holding several dense gradients of one wire dtype."""

    indices: Tuple[int, ...]      # gradient positions, ascending
    dtype: np.dtype               # wire dtype
    offsets: Tuple[int, ...]      # element offset of each gradient in the buffer
    shapes: Tuple[Shape, ...]     # shape of each gradient
    size: int            # elements in the buffer
    group: int           # fusion group (split-index group) it belongs to

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def slices(self) -> Iterator[Slot]:
        """The Slot of each gradient in the buffer."""
        for index, offset, shape in zip(self.indices, self.offsets, self.shapes):
            yield Slot(index, offset, offset + math.prod(shape), shape)


@dataclass(frozen=True)
class SparseGroup:
    """Row-sparse gradients of one wire dtype, gathered together."""

    indices: Tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class FusionPlan:
    """Buckets of dense gradients, groups of sparse ones, and the skipped ones."""

    buckets: Tuple[Bucket, ...]
    sparse: Tuple[SparseGroup, ...]
    skipped: Tuple[int, ...]
    count: int

    @property
    def nbytes(self) -> int:
        """Wire bytes of all dense buckets."""
        return sum(b.nbytes for b in self.buckets)


def _groups(count: int, split_indices: Optional[Tuple[int, ...]]) -> List[Tuple[int, int]]:
    """[start, stop) ranges of the fusion groups."""
    if not split_indices:
        return [(0, count)]
    if split_indices[-1] >= count:
        raise ValueError(f"split_indices: expecting boundaries < {count} (the number "
                         f"of gradients), got {list(split_indices)}")
    bounds = (0, *split_indices, count)
    return list(zip(bounds, bounds[1:]))


def make_plan(specs: Sequence[GradSpec], split_indices: Optional[Sequence[int]] = None,
              bucket_bytes: Optional[int] = None) -> FusionPlan:
    """Plan the fusion of ``specs`` (a sequence of GradSpec).

    With ``split_indices`` each group is fused whole (one bucket per wire
    dtype) unless ``bucket_bytes`` also caps it; without them gradients fill
    buckets of at most ``bucket_bytes`` (default DEFAULT_BUCKET_BYTES) in
    order. A gradient larger than the cap gets a bucket of its own.
    """
    splits = check_split_indices(split_indices)
    cap = check_bucket_bytes(bucket_bytes)
    if cap is None and not splits:
        cap = DEFAULT_BUCKET_BYTES
    buckets: List[Bucket] = []
    skipped: List[int] = []
    sparse_by_dtype: Dict[np.dtype, List[int]] = {}
    for group, (start, stop) in enumerate(_groups(len(specs), splits)):
        # wire dtype -> (index, shape) of the bucket being filled
        open_buckets: Dict[np.dtype, List[Tuple[int, Shape]]] = {}
        open_bytes: Dict[np.dtype, int] = {}
        closed: List[Bucket] = []

        def close(dtype: np.dtype) -> None:
            closed.append(_bucket(open_buckets.pop(dtype), dtype, group))
            del open_bytes[dtype]

        for index in range(start, stop):
            spec = specs[index]
            if spec.kind == SKIP:
                skipped.append(index)
                continue
            wire = wire_dtype(spec.dtype)
            if spec.kind == SPARSE:
                sparse_by_dtype.setdefault(wire, []).append(index)
                continue
            nbytes = spec.size * wire.itemsize
            if cap is not None and wire in open_buckets and open_bytes[wire] + nbytes > cap:
                close(wire)
            open_buckets.setdefault(wire, []).append((index, spec.shape))
            open_bytes[wire] = open_bytes.get(wire, 0) + nbytes
        for wire in list(open_buckets):
            close(wire)
        buckets.extend(sorted(closed, key=lambda b: b.indices[0]))
    sparse = tuple(SparseGroup(tuple(ix), dtype) for dtype, ix in sparse_by_dtype.items())
    return FusionPlan(tuple(buckets), sparse, tuple(skipped), len(specs))


def _bucket(members: List[Tuple[int, Shape]], dtype: np.dtype, group: int) -> Bucket:
    offsets, offset = [], 0
    for _, shape in members:
        offsets.append(offset)
        offset += math.prod(shape)
    return Bucket(indices=tuple(i for i, _ in members), dtype=dtype,
                  offsets=tuple(offsets), shapes=tuple(s for _, s in members),
                  size=offset, group=group)

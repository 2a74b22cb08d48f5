"""One wire dtype's arena of a call (pure numpy): its gradients side by side
in plan order, and how they move between the caller's arrays and private
staging memory of the arena's size. The reduce-scatter and the allgather of
the fused space (mpigrad._engine.scatter) hand an Arena to a shard backend,
which reads the arrays where it can (cross-memory) or moves the staging
memory (MPI)."""

from typing import List, NamedTuple, Sequence, Tuple

import numpy as np

from .dtypes import assign

__all__ = ["Arena", "Slot"]


class Slot(NamedTuple):
    """Where one gradient lies in a flat memory of its wire dtype (a bucket,
    an arena)."""

    position: int                # the gradient's position in the call
    start: int                   # its first element there
    stop: int                    # one past its last
    shape: Tuple[int, ...]


#: (gradient position, its slot of the staging memory, shaped as the gradient)
Staged = List[Tuple[int, np.ndarray]]


class Arena:
    """A wire dtype's gradients as one arena.

    Args:
        dtype: the wire dtype.
        slots: every gradient of the dtype, in arena order.
        arrays: the call's host arrays, by position.
        staging: private 1-D memory of the arena's size.
    """

    def __init__(self, dtype: np.dtype, slots: Sequence[Slot], arrays: Sequence[np.ndarray],
                 staging: np.ndarray) -> None:
        self.dtype = dtype
        self.slots = slots
        self.arrays = arrays
        self.staging = staging

    @property
    def size(self) -> int:
        """The arena's elements."""
        return int(self.staging.size)

    def parts(self, writes: bool) -> Tuple[List[np.ndarray], Staged]:
        """(the arena as 1-D parts side by side: each array's own memory where
        it can be read, and with ``writes`` written, as it is, in the wire
        dtype and C order; else its slot of the staging memory; the slots
        that went through staging)."""
        parts, staged = [], []
        for position, start, stop, shape in self.slots:
            array = self.arrays[position]
            if (array.dtype == self.dtype and array.flags.c_contiguous
                    and (array.flags.writeable or not writes)):
                parts.append(array.reshape(-1))
            else:
                slot = self.staging[start:stop]
                staged.append((position, slot.reshape(shape)))
                parts.append(slot)
        return parts, staged

    def fill(self, staged: Staged) -> None:
        """Copy the arrays into their staging slots (upcasting)."""
        for position, slot in staged:
            assign(slot, self.arrays[position])

    def unstage(self, staged: Staged) -> None:
        """Copy the staging slots into their arrays (casting back)."""
        for position, slot in staged:
            assign(self.arrays[position], slot)

    def unstage_all(self) -> None:
        """Copy the whole staging memory into the arrays (casting back)."""
        self.unstage([(position, self.staging[start:stop].reshape(shape))
                      for position, start, stop, shape in self.slots])

    def stage_range(self, lo: int, hi: int) -> None:
        """Copy the arrays' elements [lo, hi) of the arena into the staging memory."""
        for position, start, stop, _ in self.slots:
            first, last = max(lo, start), min(hi, stop)
            if first < last:
                assign(self.staging[first:last],
                       np.ravel(self.arrays[position])[first - start:last - start])

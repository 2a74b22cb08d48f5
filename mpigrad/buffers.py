"""Reusable bucket buffers, and pack / unpack with the cast on the copy."""

import numpy as np

from .dtypes import copy_into, scale_into

__all__ = ["BucketBuffers"]


class BucketBuffers:
    """One contiguous wire buffer per bucket of a plan, allocated once.

    Args:
        plan: the FusionPlan whose buckets these buffers hold.
    """

    def __init__(self, plan):
        self.plan = plan
        self.arrays = [np.empty(b.size, b.dtype) for b in plan.buckets]
        # shaped views of each gradient's slot, built once per plan
        self.views = [
            [(index, array[start:stop].reshape(shape))
             for index, start, stop, shape in bucket.slices()]
            for bucket, array in zip(plan.buckets, self.arrays)
        ]

    def pack(self, i, grads):
        """Copy bucket ``i``'s gradients into its buffer, upcasting half precision."""
        for index, view in self.views[i]:
            copy_into(view, grads[index])
        return self.arrays[i]

    def unpack(self, i, outs, scale=None):
        """Write bucket ``i``'s buffer (times ``scale``) into ``outs``, casting back."""
        for index, view in self.views[i]:
            scale_into(outs[index], view, scale)

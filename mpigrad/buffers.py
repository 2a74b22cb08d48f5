"""Reusable bucket buffers; pack and unpack with the cast on the copy."""

import numpy as np

__all__ = ["BucketBuffers"]


class BucketBuffers:
    """One contiguous wire buffer per bucket of a plan, allocated once.

    ``views[i]`` holds ``(position, view)`` pairs: each gradient's slot in
    bucket ``i``, shaped like the gradient. Trainers that write their
    gradients straight into these views (``Reducer.bucket_views``) skip the
    pack and unpack copies altogether.

    Args:
        plan: the FusionPlan whose buckets these buffers hold.
    """

    def __init__(self, plan):
        self.plan = plan
        self.arrays = [np.empty(b.size, b.dtype) for b in plan.buckets]
        self.slots = [list(b.slices()) for b in plan.buckets]
        self.views = [
            [(index, array[start:stop].reshape(shape)) for index, start, stop, shape in slots]
            for slots, array in zip(self.slots, self.arrays)
        ]

    def held(self, i, grads):
        """How many of bucket ``i``'s gradients are its own views (zero-copy)."""
        return sum(grads[index] is view for index, view in self.views[i])

    def pack(self, i, grads):
        """Copy bucket ``i``'s gradients into its buffer, upcasting half precision."""
        for index, view in self.views[i]:
            view[...] = grads[index]
        return self.arrays[i]

    def unpack(self, i, outs):
        """Copy bucket ``i``'s buffer into the arrays ``outs``, casting back."""
        for index, view in self.views[i]:
            outs[index][...] = view

    def unpack_new(self, i, grads, outs, flat=None):
        """Put new arrays holding bucket ``i``'s results into ``outs``.

        The results are read from ``flat`` (default: the bucket buffer). When
        every gradient of the bucket is C-contiguous and of one dtype, they are
        views into one fresh array made by a single cast-copy (or into ``flat``
        itself, when it is a private copy of the wire dtype); otherwise each
        gets a new array of its input's memory order.
        """
        source = self.arrays[i] if flat is None else flat
        bucket = self.plan.buckets[i]
        first = grads[bucket.indices[0]]
        if all(grads[j].dtype == first.dtype and grads[j].flags.c_contiguous
               for j in bucket.indices):
            if flat is None or first.dtype != flat.dtype:
                source = source.astype(first.dtype)
            for index, start, stop, shape in self.slots[i]:
                outs[index] = source[start:stop].reshape(shape)
            return
        for index, start, stop, shape in self.slots[i]:
            out = outs[index] = np.empty_like(grads[index], order="K")
            out[...] = source[start:stop].reshape(shape)

"""One reduction on the wire: dense buckets (copy, in place, zero-copy,
verified), sparse groups, and the mean's scale. Knows nothing of how the call
was checked or planned: it is handed a Planned entry and host arrays."""

import numpy as np

from .settle import all_finite, settle
from .sparse import reduce_sparse_group

__all__ = ["BucketRunner"]


class BucketRunner:
    """Runs planned reductions over a Communicator.

    Args:
        comm: the reducer's Communicator.
        settings: the reducer's Settings (mean, sparse mode, verify).
        degree: the mean's divisor (the settings' degree or the comm size).
    """

    def __init__(self, comm, settings, degree):
        self.comm = comm
        self.settings = settings
        self.degree = degree
        self.finite = None          # with check_finite: the last call's flag

    def limit(self, planned, i):
        """The finite check's limit for bucket ``i``, or None when the check
        is off."""
        return planned.limits[i] if self.settings.check_finite else None

    def note_finite(self, finite):
        """Fold one check's result (None: not checked) into the call's flag."""
        if finite is not None:
            self.finite = self.finite and finite

    def begin(self):
        """A new call: the finite flag starts true (None when not checked)."""
        self.finite = True if self.settings.check_finite else None

    def scale(self, wire):
        """The mean's factor (real, of the wire's precision), or None for a sum."""
        if not self.settings.mean or self.degree == 1:
            return None
        # a real factor, for complex wires too: (inf+1j) * (1/3+0j) would give
        # inf+nanj, where (inf+1j) * 1/3 gives inf+(1/3)j
        return np.finfo(wire).dtype.type(1.0 / self.degree)

    def settle(self, planned, i, flat):
        """Bucket ``i``'s reduced memory ``flat``: apply the mean and the finite check."""
        bucket = planned.plan.buckets[i]
        self.note_finite(settle(flat, self.scale(bucket.dtype), self.limit(planned, i)))

    def reduce(self, planned, grads, inplace):
        """Reduce host ``grads`` as ``planned`` says; return the result list."""
        plan, buffers = planned.plan, planned.buffers
        outs = list(grads)
        results = None if inplace else buffers.new_outputs(grads, outs)
        self.begin()
        with np.errstate(all="ignore"):     # nan and inf propagate, as in the trainer
            if self.settings.verify:
                self._reduce_verified(planned, grads, outs, results)
            else:
                # memory reduced where the caller reads it is settled once
                # every Allreduce is done (see settle.py)
                unsettled = []
                for i, bucket in enumerate(plan.buckets):
                    flat = self._reduce_bucket(planned, i, bucket, grads, outs, results)
                    if flat is not None:
                        unsettled.append((i, flat))
                for i, flat in unsettled:
                    self.settle(planned, i, flat)
            if plan.sparse:
                self.reduce_sparse(planned, grads, outs)
        return outs

    def _reduce_bucket(self, planned, i, bucket, grads, outs, results):
        """Reduce bucket ``i``; return the memory still to settle, if any."""
        buffers = planned.buffers
        what = lambda: f"Allreduce of bucket {i} ({bucket.nbytes} bytes, {bucket.dtype.name})"
        if results is None:
            target, unpack = buffers.inplace_target(i, grads)
            self.comm.allreduce_sum(target, what)
            if not unpack:
                return target
            self.settle(planned, i, target)
            buffers.unpack(i, outs)
            return None
        if buffers.held(i, grads):                   # reduce a copy: the inputs stay
            flat = buffers.pack(i, grads).copy()
            self.comm.allreduce_sum(flat, what)
            self.settle(planned, i, flat)
            buffers.unpack_new(i, outs, results, flat)
            return None
        target = buffers.result_span(i, results)
        if target is not None:        # results of the wire dtype, side by side:
            for index in bucket.indices:      # the copy owed is the pack
                outs[index][...] = grads[index]
            self.comm.allreduce_sum(target, what)
            return target
        flat = buffers.pack(i, grads)
        self.comm.allreduce_sum(flat, what)
        self.settle(planned, i, flat)
        buffers.unpack_new(i, outs, results)
        return None

    def _reduce_verified(self, planned, grads, outs, results):
        # every bucket is reduced into private memory and checked before
        # anything the caller sees is written
        buffers, reduced = planned.buffers, []
        for i, bucket in enumerate(planned.plan.buckets):
            flat = buffers.pack(i, grads)
            if buffers.held(i, grads):
                flat = flat.copy()
            self.comm.allreduce_sum(flat, f"Allreduce of bucket {i}")
            reduced.append(flat)
        for i, flat in enumerate(reduced):
            self.settle(planned, i, flat)
        self.comm.verify_same(reduced, "reduced buckets")
        for i, flat in enumerate(reduced):
            private = flat is not buffers.arrays[i]
            if results is None:
                if private:
                    buffers.arrays[i][...] = flat
                buffers.unpack(i, outs)
            else:
                buffers.unpack_new(i, outs, results, flat)

    def reduce_sparse(self, planned, grads, outs):
        """Reduce the plan's RowSparse gradients into ``outs``: one counts
        exchange for all of them, then one fused reduction per wire dtype."""
        plan = planned.plan
        order = [i for group in plan.sparse for i in group.indices]
        counts = self.comm.allgather_counts([grads[i].nnz for i in order])
        column = 0
        for group in plan.sparse:
            n = len(group.indices)
            results = reduce_sparse_group(
                self.comm, [grads[i] for i in group.indices], counts[:, column:column + n],
                group.dtype, self.scale(group.dtype), self.settings.sparse)
            for index, result in zip(group.indices, results):
                outs[index] = result
                if self.settings.check_finite:    # values already cast back: inf shows
                    self.note_finite(all_finite(result.values))
            column += n
        if self.settings.verify:
            self.comm.verify_same([a for i in order for a in (outs[i].indices, outs[i].values)],
                                  "reduced sparse gradients")

"""One reduction on the wire: dense buckets (copy, in place, zero-copy,
verified), sparse groups, and the mean's scale. Knows nothing of how the call
was checked or planned: it is handed a Planned entry and host arrays."""

from typing import NamedTuple, Optional

import numpy as np

from .buffers import joined
from .settle import all_finite, settle
from .sparse import reduce_sparse_group

__all__ = ["BucketRunner", "Route", "APART", "VIEWS_GIVEN"]

#: structure-check bits: in place, some bucket filled alone by a gradient is
#: summed in that gradient's own memory on this rank (BucketRunner.apart_bit);
#: bucket views of the plan were handed out (a plain reduce in node memory
#: would write into them)
APART = 64
VIEWS_GIVEN = 256


class Route(NamedTuple):
    """How the ranks agreed to sum one call (the default: unchecked calls)."""

    node_sum: bool = False           # in node memory (planned.shared)
    runs: Optional[list] = None      # the buckets summed as one message each
                                     # (None: the plan's rule for the call)


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
        # with shared_memory="auto": whether in-place calls that must be
        # packed are summed in node memory too (NodeGroups.packing_pays)
        self.node_packing = False
        # reduce into private memory, the caller's arrays written only once
        # every bucket is done: with verify, and so that a lost rank
        # (on_failure="shrink") leaves them unchanged
        self.private = settings.verify or settings.on_failure == "shrink"

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

    def reduce(self, planned, grads, inplace, route=Route()):
        """Reduce host ``grads`` as ``planned`` says, along the ``route`` the
        ranks agreed on; return the result list.

        Three phases: every bucket's memory is staged (packed where it must
        be), then summed (neighbouring buckets in one allocation as one
        message, in pieces of at most chunk_bytes), then settled (the mean,
        the finite check) and written out. Scaling or copying out a piece as
        soon as its Allreduce returned costs far more (see settle.py).
        """
        plan, buffers = planned.plan, planned.buffers
        outs = list(grads)
        results = None if inplace else buffers.new_outputs(grads, outs)
        self.begin()
        with np.errstate(all="ignore"):     # nan and inf propagate, as in the trainer
            if self.private:                # sparse included, before any write
                self._reduce_private(planned, grads, outs, results)
                return outs
            if route.node_sum:
                self._reduce_shared(planned, grads, outs, results)
            else:
                staged = [self._stage(planned, i, grads, outs, results)
                          for i in range(len(plan.buckets))]
                runs = route.runs or planned.runs["in place" if inplace else "copy"]
                self._sum(runs, [flat for flat, _ in staged])
                for i, (flat, write_out) in enumerate(staged):
                    self.settle(planned, i, flat)
                    if write_out is not None:
                        write_out()
            if plan.sparse:
                self.reduce_sparse(planned, grads, outs)
        return outs

    @staticmethod
    def zero_copy_bits(planned, grads):
        """This rank's side of the node-memory decision, as bits to agree on
        by OR over the ranks: 1, not every bucket is zero-copy; 2, some is."""
        buckets = planned.plan.buckets
        held = [planned.buffers.held(i, grads) for i in range(len(buckets))]
        return (int(not all(h == len(b.indices) for h, b in zip(held, buckets)))
                | (2 if any(held) else 0))

    @staticmethod
    def apart_bit(planned, grads):
        """APART if an in-place call sums some bucket in its gradient's own
        memory on this rank (not in the bucket buffers), else 0."""
        own = planned.buffers.own_memory
        return APART if any(own(i, grads) is not None for i in planned.filled_alone) else 0

    def route(self, planned, inplace, bits):
        """The Route of a call from the bits its ranks agreed on: in node
        memory or not; which buckets go out as one message (in place, those
        filled alone by a gradient on their own unless every rank has every
        bucket in its buffers)."""
        if not inplace:
            runs = planned.runs["copy"]
        else:
            runs = planned.runs["in place" if bits & APART else "in buffers"]
        return Route(bool(planned.shared) and self.node_sum_pays(bits, inplace), runs)

    def node_sum_pays(self, bits, inplace):
        """Whether a call sums in node memory, from the agreed ``zero_copy_bits``:
        never into zero-copy views that a plain reduce must leave alone;
        always otherwise with shared_memory=True; with "auto", calls
        zero-copy on every rank, plain reduces of plans whose bucket views
        no rank handed out (it packs into the node memory they live in), and
        packed in-place calls where packing pays (NodeGroups.packing_pays)."""
        allowed = inplace or not bits & 2
        if self.settings.shared_memory is True:
            return allowed
        if not inplace:
            return allowed and not bits & VIEWS_GIVEN
        return self.node_packing or not bits & 1

    def _reduce_shared(self, planned, grads, outs, results):
        """The node-shared path: every bucket packed into this rank's segment
        (zero-copy ones are there already), summed over the node and across
        nodes in node memory (each rank's whole arenas, its own slices pushed
        to the others), written out."""
        buffers, shared = planned.buffers, planned.shared
        buckets = planned.plan.buckets
        held = [buffers.held(i, grads) == len(b.indices) for i, b in enumerate(buckets)]
        for i in range(len(buckets)):
            if not held[i]:
                buffers.pack(i, grads)
        limits = planned.bucket_limits() if self.settings.check_finite else None
        finite = shared.reduce(self.scale, limits)
        for i in range(len(buckets)):
            if results is not None:
                buffers.unpack_new(i, outs, results)
            elif not held[i]:
                buffers.unpack(i, outs)
        self.note_finite(shared.done(finite))

    def _sum(self, runs, flats):
        """Sum the staged buckets ``flats``, each of the plan's ``runs`` as
        one message in pieces: where this rank's memory of a run is not back
        to back (a layout other ranks need not share), through a copy."""
        for first, last in runs:
            members = flats[first:last + 1]
            run = joined(members)
            what = lambda first=first, last=last, members=members: (
                f"Allreduce of bucket{'s' if last > first else ''} {first}"
                + (f"-{last}" if last > first else "")
                + f" ({sum(f.nbytes for f in members)} bytes, {members[0].dtype.name})")
            if run is not None:
                self.comm.allreduce_sum(run, what)
                continue
            run = np.concatenate(members)
            self.comm.allreduce_sum(run, what)
            offset = 0
            for flat in members:
                flat[...] = run[offset:offset + flat.size]
                offset += flat.size

    @staticmethod
    def _stage(planned, i, grads, outs, results):
        """(memory to sum for bucket ``i``, what writes its results out
        afterwards or None when they are already where the caller reads them)."""
        buffers = planned.buffers
        if results is None:
            target, unpack = buffers.inplace_target(i, grads)
            return target, (lambda: buffers.unpack(i, outs)) if unpack else None
        if buffers.held(i, grads):                   # reduce a copy: the inputs stay
            flat = buffers.pack(i, grads).copy()
            return flat, lambda: buffers.unpack_new(i, outs, results, flat)
        target = buffers.result_span(i, results)
        if target is not None:        # results of the wire dtype, side by side:
            buffers.gather(i, grads, target)      # the copy owed is the pack
            return target, None
        return buffers.pack(i, grads), lambda: buffers.unpack_new(i, outs, results)

    def _reduce_private(self, planned, grads, outs, results):
        # every bucket is reduced into private memory (and with verify,
        # checked) before anything the caller sees is written
        buffers, reduced = planned.buffers, []
        for i, bucket in enumerate(planned.plan.buckets):
            flat = buffers.pack(i, grads)
            if buffers.held(i, grads):
                flat = flat.copy()
            self.comm.allreduce_sum(flat, f"Allreduce of bucket {i}")
            reduced.append(flat)
        for i, flat in enumerate(reduced):
            self.settle(planned, i, flat)
        if self.settings.verify:
            self.comm.verify_same(reduced, "reduced buckets")
        if planned.plan.sparse:          # new objects: nothing of the caller's is written
            self.reduce_sparse(planned, grads, outs)
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

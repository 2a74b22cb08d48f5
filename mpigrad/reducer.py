"""Reducer: plan (cached per gradient signature) -> pack -> allreduce -> unpack."""

import numpy as np

from .arrays import as_array, new_like
from .buffers import BucketBuffers
from .comm import DEFAULT_CHUNK_BYTES, Communicator
from .dtypes import check_gradient_dtype
from .sparse import SPARSE_MODES, RowSparse, reduce_sparse_group
from .plan import DENSE, SKIP, SPARSE, GradSpec, check_bucket_bytes, check_split_indices, make_plan

__all__ = ["Reducer"]


def _check_degree(degree):
    if degree is None:
        return None
    if isinstance(degree, (bool, np.bool_)) or not isinstance(degree, (int, np.integer)) \
            or degree <= 0:
        raise ValueError(f"degree: expecting an int > 0 or None, got {degree!r}")
    return int(degree)


class Reducer:
    """Sum or average gradients across the ranks of a communicator.

    Args:
        comm: mpi4py intracommunicator; default ``COMM_WORLD``. It is duplicated,
            so mpigrad's traffic never matches the caller's messages.
        mean: multiply the sum by ``1/degree`` (in the wire dtype).
        degree: the mean's divisor; default the communicator size.
        split_indices: k increasing boundaries giving k+1 contiguous fusion
            groups ``[0,s0) [s0,s1) ... [sk-1,n)``.
        bucket_bytes: cap on a bucket's wire bytes; default 4 MiB when no
            split indices are given, no cap within split groups otherwise.
        skip: per-gradient bools; True leaves that gradient untouched.
        sparse: how RowSparse gradients are reduced: "gather" (Allgatherv of
            rows), "dense" (densify and allreduce) or "auto" (whichever moves
            fewer bytes, decided from every rank's row count).
        chunk_bytes: largest single Allreduce message (default 4 MiB).
    """

    def __init__(self, comm=None, *, mean=True, degree=None, split_indices=None,
                 bucket_bytes=None, skip=None, sparse="auto", chunk_bytes=DEFAULT_CHUNK_BYTES):
        if sparse not in SPARSE_MODES:
            raise ValueError(f"sparse: expecting one of {SPARSE_MODES}, got {sparse!r}")
        self.sparse = sparse
        self.mean = bool(mean)
        degree = _check_degree(degree)
        self.split_indices = check_split_indices(split_indices)
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self.skip = None if skip is None else tuple(bool(s) for s in skip)
        self._comm = Communicator(comm, chunk_bytes)
        self.degree = self._comm.size if degree is None else degree
        self._plans = {}     # signature -> (FusionPlan, BucketBuffers)

    # -- resources -------------------------------------------------------
    @property
    def comm(self):
        """The reducer's private (duplicated) communicator."""
        return self._comm.comm

    def free(self):
        """Release the communicator and the bucket buffers."""
        self._plans.clear()
        self._comm.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    # -- planning --------------------------------------------------------
    def _specs(self, grads):
        if not isinstance(grads, (list, tuple)):
            raise TypeError(f"grads: expecting a list or tuple of arrays, "
                            f"got {type(grads).__name__}")
        skip = self.skip
        if skip is not None and len(skip) != len(grads):
            raise ValueError(f"skip: expecting {len(grads)} flags (one per gradient), "
                             f"got {len(skip)}")
        specs = []
        for index, grad in enumerate(grads):
            if skip is not None and skip[index]:
                specs.append(GradSpec(SKIP, (), None))
                continue
            if isinstance(grad, RowSparse):
                specs.append(GradSpec(SPARSE, grad.dense_shape, grad.dtype,
                                      grad.indices.dtype))
                continue
            array = as_array(grad, index)
            check_gradient_dtype(array.dtype, index)
            specs.append(GradSpec(DENSE, array.shape, array.dtype))
        return tuple(specs)

    def _planned(self, specs):
        try:
            return self._plans[specs]
        except KeyError:
            plan = make_plan(specs, self.split_indices, self.bucket_bytes)
            entry = self._plans[specs] = (plan, BucketBuffers(plan))
            return entry

    def plan(self, grads):
        """The FusionPlan ``reduce(grads)`` follows."""
        return self._planned(self._specs(grads))[0]

    # -- reduction -------------------------------------------------------
    def reduce(self, grads, inplace=False):
        """Reduce ``grads`` across ranks; return a list in the same order.

        With ``inplace=True`` dense results are written into the given arrays
        (which are returned); otherwise new arrays of the same shape, dtype and
        memory order are returned. RowSparse gradients always come back as new
        RowSparse objects; skipped gradients come back as given.
        """
        specs = self._specs(grads)
        if inplace:
            for index, (spec, grad) in enumerate(zip(specs, grads)):
                if spec.kind == DENSE and not grad.flags.writeable:
                    raise ValueError(f"grads[{index}]: inplace=True needs a writeable "
                                     "array, got a read-only one; pass inplace=False")
        plan, buffers = self._planned(specs)
        outs = list(grads)
        if not inplace:
            for bucket in plan.buckets:
                for index in bucket.indices:
                    outs[index] = new_like(grads[index])
        with np.errstate(all="ignore"):     # nan and inf propagate, as in the trainer
            for i, bucket in enumerate(plan.buckets):
                buf = buffers.pack(i, grads)
                self._comm.allreduce_sum(buf)
                buffers.unpack(i, outs, self._scale(bucket.dtype))
            if plan.sparse:
                self._reduce_sparse(plan, grads, outs)
        return outs

    __call__ = reduce

    def _reduce_sparse(self, plan, grads, outs):
        # one counts exchange for every sparse gradient, then one fused
        # reduction per wire dtype
        order = [i for group in plan.sparse for i in group.indices]
        counts = self._comm.allgather_counts([grads[i].nnz for i in order])
        column = 0
        for group in plan.sparse:
            n = len(group.indices)
            results = reduce_sparse_group(
                self._comm, [grads[i] for i in group.indices], counts[:, column:column + n],
                group.dtype, self._scale(group.dtype), self.sparse)
            for index, result in zip(group.indices, results):
                outs[index] = result
            column += n

    def _scale(self, wire):
        if not self.mean or self.degree == 1:
            return None
        return wire.type(1.0 / self.degree)

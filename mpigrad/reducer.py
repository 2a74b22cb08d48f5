"""Reducer: check -> plan (cached per gradient signature) -> pack -> allreduce -> unpack."""

import numpy as np

from .arrays import from_host, to_host
from .buffers import BucketBuffers
from .check import describe, fingerprint
from .comm import DEFAULT_CHUNK_BYTES, Communicator, resolve_timeout
from .dtypes import check_gradient_dtype
from .overlap import PendingReduction
from .plan import (DENSE, SKIP, SPARSE, GradSpec, check_bucket_bytes, check_split_indices,
                   make_plan)
from .sparse import SPARSE_MODES, RowSparse, reduce_sparse_group

__all__ = ["Reducer"]


def _check_degree(degree):
    if degree is None:
        return None
    if isinstance(degree, (bool, np.bool_)) or not isinstance(degree, (int, np.integer)) \
            or degree <= 0:
        raise ValueError(f"degree: expecting an int > 0 or None, got {degree!r}")
    return int(degree)


def _check_chunk_bytes(chunk_bytes):
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes: expecting an int > 0, got {chunk_bytes!r}")
    return chunk_bytes


def _check_list(grads):
    if not isinstance(grads, (list, tuple)):
        raise TypeError(f"grads: expecting a list or tuple of arrays, "
                        f"got {type(grads).__name__}")


_CACHE_LIMIT = 64     # distinct gradient signatures kept before the caches are reset


class _Planned:
    """What the reducer caches per gradient signature."""

    __slots__ = ("plan", "buffers", "fingerprint", "description", "index_dtypes")

    def __init__(self, specs, plan, description):
        self.plan = plan
        self.buffers = BucketBuffers(plan, [s.dtype for s in specs])
        self.description = description
        self.fingerprint = fingerprint(description)
        self.index_dtypes = tuple((i, s.index_dtype) for i, s in enumerate(specs)
                                  if s.kind == SPARSE)


class Reducer:
    """Sum or average gradients across the ranks of a communicator.

    Construction is collective over ``comm``: every rank must construct.

    Args:
        comm: mpi4py intracommunicator; default ``COMM_WORLD``. It is duplicated,
            so mpigrad's traffic never matches the caller's messages.
        mean: multiply the sum by ``1/degree`` (in the wire dtype).
        degree: the mean's divisor; default the communicator size.
        split_indices: k increasing boundaries giving k+1 contiguous fusion
            groups ``[0,s0) [s0,s1) ... [sk-1,n)``.
        bucket_bytes: cap on a bucket's wire bytes; default 1 MiB when no
            split indices are given, no cap within split groups otherwise.
        skip: per-gradient bools; True leaves that gradient untouched.
        sparse: how RowSparse gradients are reduced: "gather" (Allgatherv of
            rows), "dense" (densify and allreduce) or "auto" (whichever moves
            fewer bytes, decided from every rank's row count).
        check: compare every call's gradient structure and settings across
            ranks first (one tiny Allreduce) and turn local errors into errors
            on every rank; False saves that collective, and a bad call may hang.
        timeout: seconds a collective may wait before the job is aborted with
            a diagnostic; default none. MPIGRAD_TIMEOUT overrides it.
        verify: compare a checksum of every reduced bucket across ranks and
            raise DivergenceError on a difference (a debugging aid).
        chunk_bytes: largest single Allreduce message (default 4 MiB).
    """

    def __init__(self, comm=None, *, mean=True, degree=None, split_indices=None,
                 bucket_bytes=None, skip=None, sparse="auto", check=True, timeout=None,
                 verify=False, chunk_bytes=DEFAULT_CHUNK_BYTES):
        error = None
        try:
            self.mean = bool(mean)
            self._degree = _check_degree(degree)
            self.split_indices = check_split_indices(split_indices)
            self.bucket_bytes = check_bucket_bytes(bucket_bytes)
            self.skip = None if skip is None else tuple(bool(s) for s in skip)
            if sparse not in SPARSE_MODES:
                raise ValueError(f"sparse: expecting one of {SPARSE_MODES}, got {sparse!r}")
            self.sparse = sparse
            chunk_bytes = _check_chunk_bytes(chunk_bytes)
            timeout = resolve_timeout(timeout)
        except (TypeError, ValueError) as exc:
            error, chunk_bytes, timeout = exc, DEFAULT_CHUNK_BYTES, None
        self.check, self.verify = bool(check), bool(verify)
        self._comm = Communicator(comm, chunk_bytes, timeout)
        self._plans = {}     # tuple of GradSpec -> _Planned
        self._by_key = {}    # (type, shape, dtype) per gradient -> _Planned (the fast path)
        # construction is collective: a bad argument on one rank raises everywhere
        self._comm.agree(error, 0, lambda: None)
        self.degree = self._comm.size if self._degree is None else self._degree

    def _settings(self):
        return {"mean": self.mean, "degree": self.degree, "split_indices": self.split_indices,
                "bucket_bytes": self.bucket_bytes, "sparse": self.sparse,
                "chunk_bytes": self._comm.chunk_bytes, "verify": self.verify}

    # -- resources -------------------------------------------------------
    @property
    def comm(self):
        """The reducer's private (duplicated) communicator."""
        return self._comm.comm

    @property
    def timeout(self):
        """The watchdog's limit in seconds, or None."""
        return self._comm.timeout

    def free(self):
        """Release the communicator and the bucket buffers."""
        self._plans.clear()
        self._by_key.clear()
        self._comm.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    # -- planning --------------------------------------------------------
    def _specs(self, grads):
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
            if not isinstance(grad, np.ndarray):
                raise TypeError(f"grads[{index}]: expecting an array, "
                                f"got {type(grad).__name__}")
            check_gradient_dtype(grad.dtype, index)
            specs.append(GradSpec(DENSE, grad.shape, grad.dtype))
        return tuple(specs)

    def _planned(self, specs):
        try:
            return self._plans[specs]
        except KeyError:
            if len(self._plans) >= _CACHE_LIMIT:
                self._plans.clear()
                self._by_key.clear()
            plan = make_plan(specs, self.split_indices, self.bucket_bytes)
            entry = self._plans[specs] = _Planned(specs, plan,
                                                  describe(specs, self._settings()))
            return entry

    def _lookup(self, grads):
        """The cached plan of host ``grads``, validating them only on a cache miss."""
        _check_list(grads)
        try:
            key = tuple([(type(g), g.shape, g.dtype) for g in grads])
        except AttributeError:       # not an array (an error, or a skipped object)
            return self._planned(self._specs(grads))
        planned = self._by_key.get(key)
        if planned is None or any(grads[i].indices.dtype != d
                                  for i, d in planned.index_dtypes):
            planned = self._by_key[key] = self._planned(self._specs(grads))
        return planned

    def plan(self, grads):
        """The FusionPlan ``reduce(grads)`` follows (local: no communication)."""
        _check_list(grads)
        return self._lookup(to_host(grads, inplace=False)[0]).plan

    def bucket_views(self, like):
        """Gradient arrays that live in the bucket buffers (zero-copy).

        Returns a list shaped like ``like``: for every dense gradient whose
        dtype is its wire dtype (float32, float64, complex), a C-ordered view
        into its bucket. A trainer that writes its gradients into these views
        and calls ``reduce(views, inplace=True)`` pays no pack or unpack copy.
        Half-precision, sparse and skipped positions get ``like``'s item back.
        ``like`` holds numpy arrays (zero-copy is recognised by identity).
        The views stay valid while the reducer lives and ``like``'s signature
        is reduced (a new signature gets new buffers).
        """
        planned = self._lookup(like)
        out = list(like)
        for bucket, views in zip(planned.plan.buckets, planned.buffers.views):
            for index, view in views:
                if like[index].dtype == bucket.dtype:
                    out[index] = view
        return out

    def _prepare(self, grads, inplace):
        """Local validation, then the cross-rank check.

        Returns the plan to follow, the gradients as host numpy arrays, and
        the kinds to hand results back as (None when all were numpy).
        """
        planned = error = kinds = None
        host = grads
        try:
            _check_list(grads)
            host, kinds = to_host(grads, inplace)
            planned = self._lookup(host)
            if inplace:
                for bucket in planned.plan.buckets:
                    for index in bucket.indices:
                        if not host[index].flags.writeable:
                            raise ValueError(
                                f"grads[{index}]: inplace=True needs a writeable array, "
                                "got a read-only one; pass inplace=False")
        except (TypeError, ValueError) as exc:
            if not self.check:
                raise
            error = exc
        if self.check:
            self._comm.agree(error, planned.fingerprint if planned else 0,
                             lambda: planned.description if planned else None)
        return planned, host, kinds

    # -- reduction -------------------------------------------------------
    def reduce(self, grads, inplace=False):
        """Reduce ``grads`` across ranks; return a list in the same order.

        With ``inplace=True`` dense results are written into the given arrays
        (which are returned); otherwise new arrays of the same shape, dtype and
        memory order are returned. RowSparse gradients always come back as new
        RowSparse objects; skipped gradients come back as given. On any error
        the caller's arrays are unchanged.
        """
        planned, host, kinds = self._prepare(grads, inplace)
        plan, buffers = planned.plan, planned.buffers
        grads, caller = host, grads
        outs = list(grads)
        results = None if inplace else buffers.new_outputs(grads, outs)
        with np.errstate(all="ignore"):     # nan and inf propagate, as in the trainer
            if self.verify:
                self._reduce_verified(plan, buffers, grads, outs, results)
            else:
                for i, bucket in enumerate(plan.buckets):
                    self._reduce_bucket(i, bucket, buffers, grads, outs, results)
            if plan.sparse:
                self._reduce_sparse(plan, grads, outs)
        return outs if kinds is None else from_host(outs, caller, host, kinds, inplace)

    def _reduce_bucket(self, i, bucket, buffers, grads, outs, results):
        scale = self._scale(bucket.dtype)
        what = lambda: f"Allreduce of bucket {i} ({bucket.nbytes} bytes, {bucket.dtype.name})"
        if results is None:
            target, unpack = buffers.inplace_target(i, grads)
            self._comm.allreduce_sum(target, what, scale)
            if unpack:
                buffers.unpack(i, outs)
            return
        if buffers.held(i, grads):                   # reduce a copy: the inputs stay
            flat = buffers.pack(i, grads).copy()
            self._comm.allreduce_sum(flat, what, scale)
            buffers.unpack_new(i, outs, results, flat)
            return
        target = buffers.result_span(i, results)
        if target is not None:        # results of the wire dtype, side by side:
            for index in bucket.indices:      # the copy owed is the pack
                outs[index][...] = grads[index]
            self._comm.allreduce_sum(target, what, scale)
            return
        self._comm.allreduce_sum(buffers.pack(i, grads), what, scale)
        buffers.unpack_new(i, outs, results)

    def _reduce_verified(self, plan, buffers, grads, outs, results):
        # every bucket is reduced into private memory and checked before
        # anything the caller sees is written
        reduced = []
        for i, bucket in enumerate(plan.buckets):
            flat = buffers.pack(i, grads)
            if buffers.held(i, grads):
                flat = flat.copy()
            self._comm.allreduce_sum(flat, f"Allreduce of bucket {i}", self._scale(bucket.dtype))
            reduced.append(flat)
        self._comm.verify_same(reduced, "reduced buckets")
        for i, flat in enumerate(reduced):
            private = flat is not buffers.arrays[i]
            if results is None:
                if private:
                    buffers.arrays[i][...] = flat
                buffers.unpack(i, outs)
            else:
                buffers.unpack_new(i, outs, results, flat)

    __call__ = reduce

    def start(self, grads):
        """Begin an in-place reduction to overlap with backward.

        Checks ``grads`` (collectively, as ``reduce`` does) and returns a
        PendingReduction: call ``ready(i, ...)`` as gradients are final
        (typically last parameter first) and ``wait()`` for the results. Each
        bucket is reduced as soon as it is complete, while backward goes on.
        """
        planned, host, kinds = self._prepare(grads, inplace=True)
        if self.verify:          # verified reductions check all buckets together
            return _Deferred(self, grads)
        finish = None if kinds is None else (
            lambda outs: from_host(outs, grads, host, kinds, inplace=True))
        return PendingReduction(self, planned, host, finish)

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
        if self.verify:
            self._comm.verify_same([a for i in order for a in (outs[i].indices, outs[i].values)],
                                   "reduced sparse gradients")

    def _scale(self, wire):
        if not self.mean or self.degree == 1:
            return None
        return wire.type(1.0 / self.degree)


class _Deferred:
    """start() of a verifying reducer: everything happens in wait()."""

    def __init__(self, reducer, grads):
        self._reducer, self._grads = reducer, grads

    def ready(self, *indices):
        pass

    def wait(self):
        return self._reducer.reduce(self._grads, inplace=True)

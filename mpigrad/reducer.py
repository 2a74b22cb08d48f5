"""Reducer: settings, the communicator's lifetime, the cross-rank agreement and
the public API. Planning lives in cache.py, the wire in runner.py."""

import logging
import operator
import warnings
from contextlib import contextmanager
from typing import Any, List, Optional, Sequence, Union

from mpi4py import MPI

from .arrays import from_host, to_host
from .buffers import arena_sizes, check_no_aliasing
from .cache import PlanCache
from .check import describe, fingerprint, with_structure
from .collectives import broadcast_on
from .comm import UNSET, Communicator
from .errors import PeerError, RanksLost
from .node import NodeGroups
from .overlap import PendingReduction
from .plan import FusionPlan
from .runner import VIEWS_GIVEN, BucketRunner, Route
from .settings import Settings
from .shared import NOT_SHARED, SEGMENT_DIR, SharedBuckets, shared_memory_problem
from .tree import flatten, structure, unflatten
from .ulfm import carry_on, is_process_failure

__all__ = ["Reducer"]

_log = logging.getLogger("mpigrad")


_WRITEABLE = operator.attrgetter("flags.writeable")

#: the kind of a call, agreed in its structure check: every rank must make the
#: same (their buckets go out as different messages)
_CALL_KINDS = {8: "reduce(inplace=False)", 16: "reduce(inplace=True)", 32: "start()",
               128: "bucket_views()"}


def _leaves(grads):
    """(leaves, spec) of a gradient tree; its root must be a container."""
    leaves, spec = flatten(grads)
    if spec is not None and len(leaves) == 1 and leaves[0] is grads:
        raise TypeError(f"grads: expecting a list or tuple (or a dict or other pytree) of "
                        f"arrays, got {type(grads).__name__}")
    return leaves, spec


def _node_groups(communicator, settings):
    """The NodeGroups of the shared-memory path, or None where it is off or
    cannot be had ("auto"); an error on every rank where True cannot be had."""
    mode = settings.shared_memory
    if mode is False or (mode == "auto" and (not settings.check or settings.verify
                                             or settings.on_failure == "shrink")):
        return None
    groups = NodeGroups(communicator)
    reason = groups.reasons(groups.problem or shared_memory_problem())
    if not reason and mode == "auto" and groups.local_size == 1:
        # every node has one rank (sizes are equal): nothing to share, and
        # the node path would only add a pass to MPI's Allreduce
        reason = "one rank per node"
    if not reason:
        return groups
    if mode is True:
        raise RuntimeError(f"shared_memory=True cannot be had here ({reason}); "
                           "use shared_memory='auto' or False")
    _log.debug("shared memory off: %s", reason)
    return None


def _setting(name, doc):
    """A read-only property for the setting ``name``."""
    return property(lambda self: getattr(self._settings, name), doc=doc)


class Reducer:
    """Sum or average gradients across the ranks of a communicator.

    Construction is collective over ``comm``: every rank must construct.
    Settings are fixed at construction (read-only afterwards).

    Args:
        comm: mpi4py intracommunicator; default ``COMM_WORLD``. It is duplicated,
            so mpigrad's traffic never matches the caller's messages.
        mean: multiply the sum by ``1/degree`` (in the wire dtype).
        degree: the mean's divisor; default the communicator size.
        split_indices: k increasing boundaries giving k+1 contiguous fusion
            groups ``[0,s0) [s0,s1) ... [sk-1,n)``.
        bucket_bytes: cap on a bucket's wire bytes; default MPIGRAD_BUCKET_BYTES
            if set, else 1 MiB when no split indices are given and no cap
            within split groups otherwise.
        skip: per-gradient bools; True leaves that gradient untouched.
        sparse: how RowSparse gradients are reduced: "gather" (Allgatherv of
            rows), "dense" (densify and allreduce) or "auto" (whichever moves
            fewer bytes, decided from every rank's row count).
        check: compare every call's gradient structure and settings across
            ranks first (one tiny Allreduce) and turn local errors into errors
            on every rank; False saves that collective, and a bad call may hang.
        timeout: seconds a collective may wait before the job is aborted with
            a diagnostic naming the ranks that did not arrive; default 600, or
            MPIGRAD_TIMEOUT when set; None (or MPIGRAD_TIMEOUT=0) turns it
            off. A peer that ends its program or frees its Reducer makes
            this rank raise PeerError with or without it.
        verify: compare a checksum of every reduced bucket across ranks and
            raise DivergenceError on a difference (a debugging aid).
        chunk_bytes: largest single Allreduce message; default
            MPIGRAD_CHUNK_BYTES if set, else 4 MiB.
        check_finite: after every reduce / wait, ``finite`` tells whether
            every reduced value is finite (and stays finite when cast back to
            half precision); the same on every rank.
        shared_memory: "auto" (default): the ranks of a node keep their
            buckets in memory they all map and sum them there (each rank its
            slice, then an Allreduce of the slices across nodes) where every
            node has the same number of ranks, more than one, and /dev/shm
            can hold the buckets, else MPI's Allreduce; plain reduces and zero-copy calls
            always, packed in-place ones where that beats the MPI library
            (not MPICH's, which runs near memory speed on a node); True:
            every call, required (an error on every rank where it cannot be
            had; needs check=True and verify=False); False: never. With it,
            ``bucket_views`` is collective (every rank of the communicator
            calls it alike).
        on_failure: what a lost rank (a process that failed, as MPI's fault
            tolerance reports it) does to the call in progress: "abort"
            (default): PeerError on every survivor, naming the lost ranks,
            and the Reducer is unusable (without ULFM the MPI runtime ends
            the job); "shrink": RanksLost on every survivor, after the
            Reducer has moved to the survivors' communicator (``degree``
            follows its size unless given); the caller's arrays are
            unchanged (every call reduces into private memory first). Needs
            Open MPI's ULFM: ``mpiexec --with-ft ulfm --mca btl tcp,self``.
    """

    _SETTINGS = frozenset(Settings.__dataclass_fields__)

    def __init__(self, comm: Optional[MPI.Intracomm] = None, *, mean: bool = True,
                 degree: Optional[int] = None, split_indices: Optional[Sequence[int]] = None,
                 bucket_bytes: Optional[int] = None, skip: Optional[Sequence[bool]] = None,
                 sparse: str = "auto", check: bool = True,
                 timeout: Union[Optional[float], object] = UNSET,
                 verify: bool = False, chunk_bytes: Optional[int] = None,
                 check_finite: bool = False, shared_memory: Union[str, bool] = "auto",
                 on_failure: str = "abort") -> None:
        error = None
        try:
            settings = Settings.validated(
                mean=mean, degree=degree, split_indices=split_indices,
                bucket_bytes=bucket_bytes, skip=skip, sparse=sparse, check=check,
                timeout=timeout, verify=verify, chunk_bytes=chunk_bytes,
                check_finite=check_finite, shared_memory=shared_memory,
                on_failure=on_failure)
        except (TypeError, ValueError) as exc:
            error, settings = exc, Settings()
        object.__setattr__(self, "_settings", settings)
        communicator = Communicator(comm, settings.chunk_bytes, settings.timeout)
        object.__setattr__(self, "_comm", communicator)
        # construction is collective: a bad argument on one rank raises
        # everywhere, and so do settings that differ across ranks
        agreed = describe((), settings.agreed())
        try:
            communicator.agree(error, fingerprint(agreed), lambda: agreed)
        except BaseException:
            communicator.free()
            raise
        degree = communicator.size if settings.degree is None else settings.degree
        object.__setattr__(self, "_runner", BucketRunner(communicator, settings, degree))
        object.__setattr__(self, "_cache", PlanCache(settings))
        object.__setattr__(self, "_structures", {})    # tree spec -> its fingerprint
        try:
            groups = _node_groups(communicator, settings)
        except BaseException:
            communicator.free()
            raise
        object.__setattr__(self, "_groups", groups)
        self._runner.node_packing = groups is not None and groups.packing_pays

    def __setattr__(self, name, value):
        if name in self._SETTINGS:
            raise AttributeError(f"{name}: a Reducer's settings are fixed at construction; "
                                 f"create a new one with Reducer(..., {name}=...)")
        raise AttributeError(f"'Reducer' object has no attribute {name!r} to set")

    # -- settings (read-only) ----------------------------------------------
    mean = _setting("mean", "Average (True) or sum.")
    degree = property(lambda self: self._runner.degree, doc="The mean's divisor.")
    split_indices = _setting("split_indices", "Fusion group boundaries, or None.")
    bucket_bytes = _setting("bucket_bytes", "The bucket cap given, or None for the default.")
    skip = _setting("skip", "Per-gradient skip flags, or None.")
    sparse = _setting("sparse", "RowSparse reduction mode.")
    check = _setting("check", "Cross-rank check on every call.")
    verify = _setting("verify", "Checksum results across ranks.")
    chunk_bytes = _setting("chunk_bytes", "The largest single Allreduce message.")
    timeout = _setting("timeout", "The watchdog's limit in seconds, or None.")
    check_finite = _setting("check_finite", "Whether ``finite`` is computed.")
    on_failure = _setting("on_failure", "What a lost rank does: 'abort' or 'shrink'.")
    shared_memory = _setting("shared_memory", "The shared-memory mode given.")

    @property
    def uses_shared_memory(self) -> bool:
        """Whether this Reducer sums its buckets in node-shared memory."""
        return self._groups is not None

    @property
    def finite(self) -> Optional[bool]:
        """With ``check_finite=True``: every value the last reduce (or wait)
        produced is finite; the same on every rank. None otherwise."""
        return self._runner.finite

    # -- resources -------------------------------------------------------
    @property
    def comm(self) -> MPI.Intracomm:
        """The reducer's private (duplicated) communicator."""
        return self._comm.comm

    def free(self) -> None:
        """Release the communicator and the bucket buffers (idempotent). The
        peers' twins of this Reducer raise PeerError if they are used again."""
        self._cache.clear()
        self._comm.free()

    def __del__(self):
        if getattr(self, "_cache", None) is None:                 # not fully constructed
            return
        if self._comm.comm != MPI.COMM_NULL:
            warnings.warn("a Reducer was not freed: call free() or use it in a with block",
                          ResourceWarning, stacklevel=2)
            self.free()

    @contextmanager
    def _call(self, completes=True, begin=True):
        """One collective call: one thread at a time, not after free(), and not
        once a peer left. ``completes``: the call ends here (start's ends in
        its PendingReduction's wait, which ``begin=False`` enters). A lost
        rank becomes PeerError or RanksLost (``on_failure``)."""
        try:
            with self._comm.call(begin=begin, completes=completes):
                yield
        except MPI.Exception as exc:
            if not is_process_failure(exc, self._comm.comm):
                raise
            raise self._after_loss() from None

    def _after_loss(self):
        """The error to raise on a lost rank; with "shrink", first move to the
        survivors' communicator (every survivor comes here: the first to see
        the loss revokes the communicator)."""
        before = self._comm.size
        lost = carry_on(self._comm.comm, self._comm.rejoin, self._settings.timeout)
        if self._settings.on_failure == "shrink":
            self._runner.degree = self._settings.degree or self._comm.size
            return RanksLost(lost, self._comm.size)
        error = PeerError(lost, ["its process failed"] * len(lost),
                          f"the Reducer lost ranks of its {before}")
        self._comm.channel.broken = error
        return error

    def __enter__(self) -> "Reducer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    # -- planning --------------------------------------------------------
    def plan(self, grads: Sequence[Any]) -> FusionPlan:
        """The FusionPlan ``reduce(grads)`` follows (local: no communication);
        bucket indices are positions in the flattening order of ``grads``."""
        return self._cache.lookup(to_host(_leaves(grads)[0], inplace=False)[0]).plan

    def bucket_views(self, like: Sequence[Any]) -> List[Any]:
        """Gradient arrays that live in the bucket buffers (zero-copy).

        Returns ``like``'s structure: for every dense gradient whose
        dtype is its wire dtype (float32, float64, complex), a C-ordered view
        into its bucket. A trainer that writes its gradients into these views
        and calls ``reduce(views, inplace=True)`` pays no pack or unpack copy.
        Half-precision, sparse and skipped positions get ``like``'s item back.
        ``like`` holds numpy arrays (zero-copy is recognised by identity).
        The views stay valid while the reducer lives and ``like``'s signature
        is reduced (a new signature gets new buffers). Where the reducer uses
        node memory (``uses_shared_memory``), the views live there and this
        call is collective: every rank calls it with the same structure;
        with ``shared_memory=True``, a plain ``reduce`` of the same signature
        packs into that memory too (the views then hold its results; "auto"
        sums such calls through MPI instead).
        """
        if self._groups is not None:            # node memory: set up collectively
            with self._call():
                planned = self._prepare(like, inplace=False, kind=128)[0]
            like, spec = _leaves(like)
        else:
            like, spec = _leaves(like)
            planned = self._cache.lookup(like)
        planned.views_given = True
        out = list(like)
        for bucket, views in zip(planned.plan.buckets, planned.buffers.views):
            for index, view in views:
                if like[index].dtype == bucket.dtype:
                    out[index] = view
        return unflatten(spec, out)

    def _prepare(self, grads, inplace, kind=None):
        """Local validation, then the cross-rank check; ``kind``: one of
        _CALL_KINDS (default: reduce's, by ``inplace``).

        Returns the plan to follow, the leaves as given, the leaves as host
        numpy arrays, the kinds to hand results back as (None when all were
        numpy), the tree spec to rebuild the caller's structure with, and
        the Route to sum along (agreed by every rank).
        """
        planned = error = kinds = spec = None
        leaves = host = []
        try:
            leaves, spec = _leaves(grads)
            host, kinds = to_host(leaves, inplace)
            planned = self._cache.lookup(host)
            if inplace:
                if not all(map(_WRITEABLE, planned.pick_dense(host))):
                    index = next(i for i in planned.dense_positions
                                 if not host[i].flags.writeable)
                    raise ValueError(f"grads[{index}]: inplace=True needs a writeable array, "
                                     "got a read-only one; pass inplace=False")
                check_no_aliasing(host, planned.own_memory, planned.dense_positions)
        except (TypeError, ValueError) as exc:
            if not self._settings.check:
                raise
            error = exc
        route = Route()
        if self._settings.check:
            tree = structure(spec)
            # bits of every rank decided on together: the call's kind; in
            # place, whether some bucket is summed outside the buffers
            # (APART); with node memory, 4: a plan has no node buckets yet
            # (all then set them up); VIEWS_GIVEN; 1 and 2: how zero-copy the
            # call is (BucketRunner.zero_copy_bits)
            bits = kind or (16 if inplace else 8)
            if inplace and planned is not None:
                bits |= self._runner.apart_bit(planned, host)
            if self._groups is not None and planned is not None and planned.plan.buckets:
                bits |= (4 * (planned.shared is None)
                         | VIEWS_GIVEN * planned.views_given
                         | self._runner.zero_copy_bits(planned, host))
            _, bits = self._comm.agree(error, planned.fingerprint
                                       ^ self._structure_fingerprint(spec, tree) if planned
                                       else 0, lambda: with_structure(planned.description, tree)
                                       if planned else None, bits=bits)
            made = [name for bit, name in _CALL_KINDS.items() if bits & bit]
            if len(made) > 1:
                raise ValueError(f"expecting the same call on every rank, got {' and '.join(made)} "
                                 "on different ranks: their buckets would go out as different "
                                 "messages; make every rank call alike")
            if bits & 4:
                self._share(planned)
            route = self._runner.route(planned, inplace, bits)
        return planned, leaves, host, kinds, spec, route

    def _share(self, planned):
        """Move ``planned``'s buckets into node memory (collective over the node)."""
        shared = SharedBuckets(self._groups, arena_sizes(planned.plan.buckets))
        if shared.failure is None:
            planned.move_to_shared(shared)
        elif self._settings.shared_memory is True:
            raise RuntimeError(f"shared_memory=True: node memory for the buckets could not "
                               f"be made ({shared.failure}); free space in {SEGMENT_DIR} "
                               "or use shared_memory='auto'")
        else:
            _log.debug("shared memory: %s; this plan uses MPI's Allreduce", shared.failure)
            planned.shared = NOT_SHARED

    def _structure_fingerprint(self, spec, tree):
        if spec is None:
            return 0
        try:
            return self._structures[spec]
        except KeyError:
            return self._structures.setdefault(spec, fingerprint(tree))

    # -- reduction -------------------------------------------------------
    def reduce(self, grads: Sequence[Any], inplace: bool = False) -> List[Any]:
        """Reduce ``grads`` across ranks; return them in the same structure.

        ``grads`` is a list or tuple of arrays (a list comes back), or any
        pytree of them (nested dicts, lists, tuples, namedtuples; jax's nodes
        when jax is imported), which comes back in the same structure. Its
        leaves are numbered in flattening order (dicts by sorted key): ``skip``,
        ``split_indices`` and error messages refer to those positions. With ``inplace=True`` dense results are written into the given arrays
        (which are returned); otherwise new arrays of the same shape, dtype and
        memory order are returned. RowSparse gradients always come back as new
        RowSparse objects; skipped gradients come back as given. On any error
        the caller's arrays are unchanged.
        """
        with self._call():
            planned, leaves, host, kinds, spec, route = self._prepare(grads, inplace)
            outs = self._runner.reduce(planned, host, inplace, route)
        if kinds is not None:
            outs = from_host(outs, leaves, host, kinds, inplace)
        return unflatten(spec, outs)

    __call__ = reduce

    def broadcast(self, tree: Any, root: int = 0) -> Any:
        """``mpigrad.broadcast`` of ``tree`` from ``root`` over this Reducer's
        communicator (after a shrink, the survivors': rank 0 is the lowest
        survivor), watched, and with a lost rank handled as ``on_failure``
        says."""
        with self._call():
            return broadcast_on(self._comm, tree, root)

    def start(self, grads: Sequence[Any]) -> PendingReduction:
        """Begin an in-place reduction to overlap with backward.

        Checks ``grads`` (collectively, as ``reduce`` does) and returns a
        PendingReduction: call ``ready(i, ...)`` as gradients are final
        (typically last parameter first) and ``wait()`` for the results. Each
        bucket is reduced as soon as it is complete, while backward goes on
        (with ``verify=True``, all together in ``wait()``).
        """
        with self._call(completes=False):
            planned, leaves, host, kinds, spec, route = self._prepare(grads, True, kind=32)
        finish = None
        if kinds is not None or spec is not None:
            def finish(outs):
                if kinds is not None:
                    outs = from_host(outs, leaves, host, kinds, inplace=True)
                return unflatten(spec, outs)
        return PendingReduction(self._runner, planned, host, finish, route,
                                call=lambda: self._call(begin=False))

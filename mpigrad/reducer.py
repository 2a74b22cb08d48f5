"""Reducer: the face. Its arguments, settings and lifetime, and its calls,
each one a call of its engine (mpigrad._engine.engine), which negotiates it
into a CallPlan and runs it."""

import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from ._base.settings import UNSET, Settings
from ._base.validate import rank_of
from ._engine.engine import Engine, Overlapped
from ._collective import Group
from ._collective.device import reduce_on_device, takes_device_path
from ._base.tree import flatten_all, structure, unflatten
from ._engine.world import Intracomm
from ._engine.plan import FusionPlan
from .collectives import allgather_object_on, allreduce_on, broadcast_on

__all__ = ["Reducer", "PendingReduction", "PendingShards"]


def _setting(name: str, doc: str) -> Any:
    """A read-only property for the setting ``name``."""
    return property(lambda self: getattr(self._settings, name), doc=doc)


_SETTING_NAMES = frozenset(Settings.__dataclass_fields__) - {"node_size"}


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
        cross_memory: "auto" (default, with shared_memory="auto"): blocking
            calls whose gradients are not all in the node's shared buckets
            are summed on the node by reading and writing the peers' memory
            directly (cross-memory attach: process_vm_readv/writev), where
            every local rank can (probed once, agreed), or by MPI's
            Allreduce where that measured faster (a plan's first calls
            try both, see ``measured``); True: required (an error on every
            rank where it cannot be had); False: never.
        on_failure: what a lost rank (a process that failed, as MPI's fault
            tolerance reports it) does to the call in progress: "abort"
            (default): PeerError on every survivor, naming the lost ranks,
            and the Reducer is unusable (without ULFM the MPI runtime ends
            the job); "shrink": RanksLost on every survivor, after the
            Reducer has moved to the survivors' communicator (``degree``
            follows its size unless given); the caller's arrays are
            unchanged (every call reduces into private memory first). Needs
            Open MPI's ULFM: ``mpiexec --with-ft ulfm --mca btl tcp,self``.
        wire: None (default): buckets travel in their own dtype; "bfloat16":
            float32 buckets summed through MPI, and the step across nodes of
            node sums, travel as bfloat16 (half the bytes) and are summed in
            float32: each rank's addend rounded once to bfloat16, the sum
            rounded once (docs/performance.md, "The bfloat16 wire"); node
            sums stay float32; reduce_scatter and float64 buckets are not
            affected. The same bits on every rank. "float16": the same with
            float16 (finer, but a value past 65504 becomes inf: check_finite
            sees it). A gradient never travels coarser than its own dtype
            (precision or range): a call of float16 gradients only takes
            the float16 wire under "bfloat16", one of bfloat16 gradients
            only the bfloat16 wire under "float16", one mixing a half with
            float32 gradients or the other half no wire.
            MPIGRAD_WIRE sets the default (the torch.distributed backend's
            sums take it from there).
        reproducible: exact, order-independent sums (docs/semantics.md,
            "Reproducible sums"): each result is the sum (or mean) of every
            rank's addends rounded once, to nearest even, to the gradient's
            dtype, as ``math.fsum`` would give it: the same bits for the same
            addends under any split across ranks, any rank count, node layout,
            chunk or bucket size, and either MPI library. Summed as integers
            through MPI, or where one node holds every rank and cross_memory is
            "auto", float32 and half-precision gradients in one cross-memory
            pass (float64 sums, exact where they are summed so); no other node
            sums, no wire
            (shared_memory=True, cross_memory=True and wire=... are refused);
            ``reduce`` also takes an ``ExactSum`` of micro-batches; ``start``
            sums everything in ``wait``; ``reduce_scatter`` keeps this rank's
            shard of the exact sums (all of them summed, not 1/p). The mean divides the exact
            sum once (degree below 16384). None (default): MPIGRAD_REPRODUCIBLE=1
            turns it on (for the Reducers other faces make too: the
            torch.distributed backend's, DistributedOptimizer's), else off.
    """

    __slots__ = ("_settings", "_engine", "_group", "__weakref__")

    def __init__(self, comm: Optional[Intracomm] = None, *, mean: bool = True,
                 degree: Optional[int] = None, split_indices: Optional[Sequence[int]] = None,
                 bucket_bytes: Optional[int] = None, skip: Optional[Sequence[bool]] = None,
                 sparse: str = "auto", check: bool = True,
                 timeout: Union[Optional[float], object] = UNSET,
                 verify: bool = False, chunk_bytes: Optional[int] = None,
                 check_finite: bool = False, shared_memory: Union[str, bool] = "auto",
                 cross_memory: Union[str, bool] = "auto", on_failure: str = "abort",
                 wire: Optional[str] = None, reproducible: Optional[bool] = None) -> None:
        error = None
        try:
            settings = Settings.validated(
                mean=mean, degree=degree, split_indices=split_indices,
                bucket_bytes=bucket_bytes, skip=skip, sparse=sparse, check=check,
                timeout=timeout, verify=verify, chunk_bytes=chunk_bytes,
                check_finite=check_finite, shared_memory=shared_memory,
                cross_memory=cross_memory, on_failure=on_failure, wire=wire,
                reproducible=reproducible)
        except Exception as exc:    # any local error: raised on every rank
            error, settings = exc, Settings()
        self._settings = settings
        # construction is collective: a bad argument (or environment
        # variable) on one rank raises everywhere, and so do settings that
        # differ across ranks
        self._engine = Engine(comm, settings, error)
        # broadcast, allreduce and allgather_object: calls of the Reducer's own,
        # its floating-point sums and means its own engine's
        self._group = Group(self._engine.comm, calls=self._engine.call, engine=self._engine)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SETTING_NAMES:
            raise AttributeError(f"{name}: a Reducer's settings are fixed at construction; "
                                 f"create a new one with Reducer(..., {name}=...)")
        super().__setattr__(name, value)

    # -- settings (read-only) ----------------------------------------------
    mean = _setting("mean", "Average (True) or sum.")
    degree = property(lambda self: self._engine.degree, doc="The mean's divisor.")
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
    cross_memory = _setting("cross_memory", "The cross-memory mode given.")
    wire = _setting("wire", "What float32 buckets travel as: None, 'bfloat16' or 'float16'.")
    reproducible = _setting("reproducible", "Exact, order-independent sums.")

    @property
    def uses_cross_memory(self) -> bool:
        """Whether blocking calls not zero-copy everywhere are summed through
        cross-memory attach (see ``cross_memory``)."""
        return self._engine.backends.cross is not None

    @property
    def backend(self) -> Optional[str]:
        """What summed the dense buckets of the last reduce (or wait): "mpi",
        "node memory" (the shared buckets), "cross-memory", for a start()
        across nodes "cross-memory, overlapped", with reproducible=True
        "exact (integer sums through MPI)" or "exact (float64 sums through
        cross-memory)"; None before."""
        return self._engine.backend

    @property
    def measured(self) -> Dict[str, float]:
        """How ``backend`` was chosen for the last reduce: where two backends
        can sum a plan's blocking calls (cross_memory="auto": cross-memory and
        MPI's Allreduce, and node memory for an in-place call that packs every
        bucket), its first calls try each in turn and the ranks agree on the
        fastest; then {each candidate: its time in ms, the slowest rank's
        best}. Empty where nothing was measured or is still being tried."""
        return dict(self._engine.measured)

    @property
    def uses_shared_memory(self) -> bool:
        """Whether this Reducer sums its buckets in node-shared memory."""
        return self._engine.backends.groups is not None

    @property
    def finite(self) -> Optional[bool]:
        """With ``check_finite=True``: every value the last reduce (or wait)
        produced is finite; the same on every rank. None otherwise."""
        return self._engine.finite

    # -- resources -------------------------------------------------------
    @property
    def comm(self) -> Intracomm:
        """The reducer's private (duplicated) communicator."""
        comm: Intracomm = self._group.comm
        return comm

    def free(self) -> None:
        """Release the communicator and the bucket buffers (idempotent). The
        peers' twins of this Reducer raise PeerError if they are used again."""
        self._group.free()
        self._engine.free()

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # at interpreter exit the peers were told already (watch.py's atexit
        # goodbye) and module globals may be gone: nothing to free
        engine = getattr(self, "_engine", None)
        if _finalizing() or engine is None:       # or not fully made
            return
        if not engine.comm.freed:
            warnings.warn("a Reducer was not freed: call free() or use it in a with block",
                          ResourceWarning, stacklevel=2)
            self.free()

    def __enter__(self) -> "Reducer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    # -- planning --------------------------------------------------------
    def plan(self, grads: Sequence[Any]) -> FusionPlan:
        """The FusionPlan ``reduce(grads)`` follows (local: no communication);
        bucket indices are positions in the flattening order of ``grads``."""
        return self._engine.plan(grads)

    def bucket_views(self, like: Any) -> Any:
        """Gradient arrays that live in the bucket buffers (zero-copy).

        Returns ``like``'s structure: for every dense gradient whose
        dtype is its wire dtype (float32, float64, complex), a C-ordered view
        into its bucket. A trainer that writes its gradients into these views
        and calls ``reduce(views, inplace=True)`` pays no pack or unpack copy.
        Half-precision, sparse and skipped positions get ``like``'s item back.
        ``like`` holds numpy arrays. Zero-copy is recognised by memory: an
        array (or a torch tensor made with ``torch.from_numpy``) of exactly a
        view's memory counts as the view. The views stay valid while the
        reducer lives and ``like``'s signature is reduced (a new signature
        gets new buffers). Where the reducer uses node memory
        (``uses_shared_memory``), the views live there and this call is
        collective: every rank calls it with the same structure; with
        ``shared_memory=True``, a plain ``reduce`` of the same signature
        packs into that memory too (the views then hold its results; "auto"
        sums such calls through MPI instead).
        """
        return self._engine.bucket_views(like)

    # -- reduction -------------------------------------------------------
    def reduce(self, grads: Any, inplace: bool = False, *, out: Any = None,
               agree: Optional[Dict[str, Any]] = None) -> Any:
        """Reduce ``grads`` across ranks; return them in the same structure.

        ``grads`` is a list or tuple of arrays (a list comes back), or any
        pytree of them (nested dicts, lists, tuples, namedtuples; jax's nodes
        when jax is imported), which comes back in the same structure. Its
        leaves are numbered in flattening order (dicts by sorted key): ``skip``,
        ``split_indices`` and error messages refer to those positions. With
        ``inplace=True`` dense results are written into the given arrays
        (which are returned); otherwise new arrays of the same shape, dtype and
        memory order are returned. RowSparse gradients always come back as new
        RowSparse objects; skipped gradients come back as given. On any error
        the caller's arrays are unchanged.

        ``out``: the arrays to write a plain reduce's results into instead of new
        ones (returned in ``grads``' structure): one per gradient, in its structure,
        a writeable numpy array of the gradient's shape and dtype (None for a
        RowSparse gradient, which comes back new; None or an array for a skipped
        one, which comes back as it came, or copied there), sharing no memory with
        another or with a gradient. The sum reads the gradients and writes there
        (a compiled step's output buffers: jax's, MindSpore's), no copy of its own;
        on an error they may hold partial results.

        ``agree``: the caller's values (names to ints, strings, ... such as a
        step count) that every rank must pass alike; checked in the call's
        one agreement (with ``check=True``): a difference raises
        StructureMismatchError on every rank, naming the value.

        With ``reproducible=True``, ``grads`` may be an ``mpigrad.ExactSum``
        (micro-batches accumulated exactly; every rank passes one): its exact
        sums are reduced into new arrays in the structure and kinds of its
        ``like``.
        """
        if inplace and out is not None:
            raise ValueError("reduce: out= gives the arrays a plain reduce writes; with "
                             "inplace=True the results are written into grads: pass one")
        if agree is None and out is None and self._sums_on_device(grads):
            leaves, spec = flatten_all(grads)
            outs = reduce_on_device(self._group, leaves, inplace,
                                    self._engine.degree if self._settings.mean else 1,
                                    structure(spec))
            return unflatten(spec, outs)
        return self._engine.reduce(grads, inplace, agree, out)

    __call__ = reduce

    def _sums_on_device(self, grads: Any) -> bool:
        """Whether a call of ``grads`` is summed in device memory by a
        device-aware MPI (mpigrad._collective.device): device arrays only, none
        of the settings that need the host's kernels."""
        settings = self._settings
        if (settings.skip or settings.reproducible or settings.wire or settings.verify
                or settings.check_finite or settings.on_failure != "abort"
                or not settings.check or isinstance(grads, np.ndarray)):
            return False
        first = grads[0] if isinstance(grads, (list, tuple)) and grads else None
        if isinstance(first, np.ndarray):          # (a numpy call pays nothing more)
            return False
        leaves = flatten_all(grads)[0]
        return not any(isinstance(a, np.ndarray) for a in leaves) and takes_device_path(leaves)

    # -- shards: the halves of a sharded optimizer step -------------------
    def shards(self, grads: Any, rank: Optional[int] = None) -> Dict[np.dtype, List[Any]]:
        """Which elements ``rank`` (default this rank) receives from
        ``reduce_scatter(grads)`` (local: no communication): {wire dtype:
        [(gradient position, first, stop)]}, flat element ranges in C order
        of the gradients, in the order of that rank's shard. Each wire
        dtype's dense gradients, in plan order, are cut into balanced
        contiguous ranges, rank r of p owning [n r / p, n (r + 1) / p)."""
        comm = self._engine.comm
        return self._engine.shards(grads, comm.rank if rank is None
                                   else rank_of("rank", rank, comm.size))

    def reduce_scatter(self, grads: Any, *, agree: Optional[Dict[str, Any]] = None
                       ) -> Dict[np.dtype, np.ndarray]:
        """The mean (or sum) of ``grads`` over the ranks, of which this rank
        receives only its shard (``shards`` says which elements): {wire
        dtype: 1-D numpy array} (float16 and bfloat16 gradients summed and
        returned in float32). Checked and watched as ``reduce``; the caller's
        arrays are not written; RowSparse gradients are refused (reduce them
        with ``reduce``); ``finite`` covers every shard (check_finite).
        ``agree`` as for ``reduce``. A shard returned is reused by a later
        call once nothing references it."""
        return self._engine.reduce_scatter(grads, agree)

    def start_reduce_scatter(self, grads: Any, *, agree: Optional[Dict[str, Any]] = None
                             ) -> "PendingShards":
        """Begin a ``reduce_scatter`` to overlap with backward: call
        ``ready(i, ...)`` as gradients are final and ``wait()`` for the
        shards. Through MPI each bucket's reduce-scatter goes out as soon as
        it is complete (last bucket first, as backward finishes them); on one
        node with cross-memory sums, all together in ``wait()``."""
        return PendingShards(self._engine.start_reduce_scatter(grads, agree))

    def allgather_shards(self, shards: Optional[Dict[Any, np.ndarray]], into: Any) -> Any:
        """Gather every rank's ``shards`` (as ``reduce_scatter(into)`` gave
        them, updated: say the optimizer's new parameter values) into the
        arrays of ``into``, written in place and returned in its structure
        (half precision cast back from float32). ``shards=None``: each rank's
        shard is already in its own ``into`` (updated there, in place: its
        ``shards`` elements); only the others' are gathered. Collective and
        checked as ``reduce(inplace=True)``: shards of the wrong dtypes or
        sizes on one rank raise there and PeerError on the others, nothing
        written."""
        return self._engine.allgather_shards(shards, into)

    def broadcast(self, tree: Any, root: int = 0) -> Any:
        """``mpigrad.broadcast`` of ``tree`` from ``root`` over this Reducer's
        communicator (after a shrink, the survivors': rank 0 is the lowest
        survivor), watched, and with a lost rank handled as ``on_failure``
        says."""
        return broadcast_on(self._group, tree, root)

    def allreduce(self, value: Any, op: str = "mean") -> Any:
        """``mpigrad.allreduce`` of ``value`` (a metric) over this Reducer's
        communicator (after a shrink, the survivors'), watched, and with a lost
        rank handled as ``on_failure`` says. Its floating-point sums and means
        are this Reducer's own reductions, whatever their size: its settings
        (``reproducible``, ``wire``, node and cross-memory sums) give their
        bits, those of ``reduce`` of the same arrays, and a mean divides by
        ``degree``."""
        return allreduce_on(self._group, value, op)

    def agree(self, values: Optional[Dict[str, Any]] = None, *,
              error: Optional[BaseException] = None) -> None:
        """One tiny agreement over this Reducer's communicator (every rank
        calls it): ``values`` (names to ints, strings, ... as ``reduce``'s
        ``agree``) that differ raise StructureMismatchError on every rank,
        naming the value; a local ``error`` (a check that failed on this rank)
        raises here and PeerError on the others. With neither anywhere, it
        returns: the ranks go on in step."""
        self._engine.agree(values, error)

    def allgather_object(self, obj: Any) -> List[Any]:
        """``mpigrad.allgather_object`` of ``obj`` over this Reducer's
        communicator (after a shrink, the survivors'), watched, and with a
        lost rank handled as ``on_failure`` says."""
        return allgather_object_on(self._group, obj)

    def start(self, grads: Any, *, agree: Optional[Dict[str, Any]] = None
              ) -> "PendingReduction":
        """Begin an in-place reduction to overlap with backward.

        Checks ``grads`` (collectively, as ``reduce`` does) and returns a
        PendingReduction: call ``ready(i, ...)`` as gradients are final
        (typically last parameter first) and ``wait()`` for the results. Each
        bucket is reduced as soon as it is complete, while backward goes on
        (with ``verify=True``, and in node memory, all together in ``wait()``).
        ``agree`` as for ``reduce``.
        """
        return PendingReduction(self._engine.start(grads, agree))


class PendingReduction:
    """An in-flight in-place reduction (``Reducer.start``): mark gradients
    with ``ready``, finish with ``wait``."""

    def __init__(self, call: Overlapped) -> None:
        self._call = call
        self._finished = False

    def ready(self, *indices: int) -> None:
        """Mark gradients as final; launch every bucket that became complete."""
        self._call.mark(*indices)

    def wait(self, *, agree: Optional[Dict[str, Any]] = None) -> Any:
        """Finish every bucket (launching those not yet marked) and the sparse
        gradients; return the reduced gradients (the given arrays, written in
        place) in the given structure.

        The call ends with one tiny agreement (with ``check=True``): of
        ``agree``, values known only once the gradients are done (say, the
        backward passes they hold) that every rank must pass alike, else
        StructureMismatchError on every rank.
        """
        if self._finished:
            raise RuntimeError("wait: this call has already finished")
        self._finished = True
        return self._call.finish(agree)


class PendingShards(PendingReduction):
    """An in-flight reduce-scatter (``Reducer.start_reduce_scatter``): mark
    gradients with ``ready``; ``wait`` returns {wire dtype: this rank's
    shard}, as ``reduce_scatter`` (``agree`` as for a reduction's wait)."""

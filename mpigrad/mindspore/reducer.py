"""DistributedGradReducer: MindSpore's cell of that name (mindspore.nn,
grad_reducer.py) on one mpigrad Reducer, on CPU under ``mpiexec`` or
``srun``: in PyNative mode a call reduces the tensors' memory directly; in
GRAPH_MODE (and inside ``ms.jit``) its ``construct`` is one host call in the
compiled step (host_call.py: on the step's own buffers where a C compiler
works) that runs the same Reducer on the gradients' arrays."""

from typing import Any, Collection, Dict, FrozenSet, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn

from .._base.row_sparse import RowSparse
from ..reducer import Reducer
from .host_call import HostOp, reshaped
from .launch import check_launch, communicator
from .tensors import ROW_TENSORS, to_numpy, to_row_sparse, to_row_tensor, to_tensor

__all__ = ["DistributedGradReducer"]


class DistributedGradReducer(nn.Cell):
    """Average (or sum) gradients across MPI ranks, as MindSpore's
    ``nn.DistributedGradReducer`` does across its devices.

    Construction is collective over the group. A call on the tuple of
    gradients (one per parameter, as ``ms.value_and_grad`` or ``ops.GradOperation``
    give them) returns the reduced tuple: new tensors (sharing memory with
    mpigrad's results: no copy back), the caller's left as they were. In
    GRAPH_MODE, or inside ``ms.jit``, a call inside a compiled ``construct``
    (``self.grad_reducer(grads)``, as MindSpore's own) is one host call of
    the step on the gradients' arrays, reduced by the same Reducer (the same
    bits); row tensors are taken in PyNative mode only.

    Args:
        parameters: the parameters whose gradients are reduced, in the
            gradients' order (``optimizer.parameters``, ``net.trainable_params()``).
            A parameter with ``layerwise_parallel`` set (or MindSpore's
            PyNative shard or parameter-server flag) is not reduced: its
            gradient comes back as it was.
        mean: divide the sum by ``degree`` (a multiplication by ``1/degree``
            in float32, as MindSpore's); None reads ``gradients_mean`` from
            ``ms.get_auto_parallel_context``.
        degree: the mean's divisor, an int > 0; default the group's size.
        fusion_type: how gradients are fused into buckets (contiguous groups
            each summed by one ``Allreduce`` per bucket of mpigrad's cap):
            parameters whose ``comm_fusion`` differ split the groups where it
            changes; else with 1 (the default) ``all_reduce_fusion_config``
            of the auto-parallel context gives split indices where set, or
            all gradients form one group; 0 reduces each gradient alone.
        group: None or MindSpore's world group name (COMM_WORLD), an mpi4py
            communicator, or a list of world ranks (every world rank then
            constructs, each with the list of its own group).
        lookup_tables: parameters (or their names) whose dense gradients
            hold few non-zero rows, such as ``nn.Embedding``'s table: their
            non-zero rows are gathered (``Allgatherv``) instead of the whole
            table summed; a dense gradient comes back.
        **options: mpigrad ``Reducer`` settings (``timeout``, ``check_finite``,
            ``bucket_bytes``, ``wire``, ``reproducible``, ...); ``sparse``
            defaults to "gather", MindSpore's ``AllGather`` of row tensors.
    """

    def __init__(self, parameters: Sequence[Any], mean: Optional[bool] = None,
                 degree: Optional[int] = None, fusion_type: int = 1, group: Any = None, *,
                 lookup_tables: Collection[Any] = (), **options: Any) -> None:
        super().__init__(auto_prefix=False)
        self._host = _Host(parameters, mean, degree, fusion_type, group, lookup_tables, options)
        self._op = HostOp(self._host.shapes, [p.dtype for p in self._host.parameters],
                          self._host.reduce_into, self._host.reduce_arrays)
        # what construct compiles: the op, and its key first where it has one; the
        # positions of its scalars, taken and given as shape (1,) (host_call.HostOp)
        self._custom, self._key = self._op.op, self._op.key_tensor
        self._keyed = self._key is not None
        self._scalars = self._op.scalars
        # what a compiled step raises, where it cannot run ("" where it can): the
        # pyfunc op cannot take an empty tensor (MindSpore's own "memcpy failed")
        empty = [p.name for p in self._host.parameters if 0 in tuple(p.shape)]
        self._refused = "" if self._op.route == "aot" or not empty else (
            "a compiled step without mpigrad's C trampoline (the pyfunc host call: no C "
            f"compiler here) cannot take empty gradients, and parameters {empty} are empty: "
            "install gcc (the aot host call takes them), leave them out of the reducer's "
            "parameters, or reduce in PyNative mode")

    @property
    def mean(self) -> bool:
        """Whether the sum is divided by ``degree``."""
        return bool(self._host.reducer.mean)

    @property
    def degree(self) -> int:
        """The mean's divisor."""
        return int(self._host.reducer.degree)

    @property
    def finite(self) -> Optional[bool]:
        """With ``check_finite=True``: every value the last call produced is
        finite (the same on every rank: the loss scale's overflow flag)."""
        return self._host.reducer.finite

    @property
    def host_call(self) -> str:
        """How a compiled step (GRAPH_MODE, ``ms.jit``) reaches the reducer: "aot" (an
        aot Custom op: the step's own buffers) or "pyfunc" (copies, where no C compiler
        builds mpigrad's trampoline)."""
        return self._op.route

    @property
    def reducer(self) -> Reducer:
        """The mpigrad Reducer underneath (its ``comm``, ``allreduce``, ``broadcast``)."""
        return self._host.reducer

    def free(self) -> None:
        """Release the communicator and the buckets (idempotent), once every
        step MindSpore has launched has run: PyNative and ``ms.jit`` steps
        run asynchronously (MindSpore's pipeline), so a step's host call may
        still be due when the trainer frees its reducer."""
        self._host.wait_for_launched_steps()
        if ms.get_context("device_target") != "CPU":   # (CPU: no streams; an error)
            ms.runtime.synchronize()
        self._op.release()
        self._host.reducer.free()

    def __enter__(self) -> "DistributedGradReducer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __call__(self, grads: Sequence[Any]) -> Tuple[Any, ...]:
        """The reduced gradients: a tuple of ``grads``' kinds (Tensor,
        RowTensor, RowTensorInner) and dtypes. A local error (a gradient of
        the wrong shape or kind) raises here and PeerError on the other
        ranks. In GRAPH_MODE: the compiled ``construct``."""
        if ms.get_context("mode") == ms.GRAPH_MODE:
            try:
                return tuple(super().__call__(_variable(tuple(grads))))
            except RuntimeError as error:    # the host call's own error, where it failed
                if self._op.failure is not None:
                    raise self._op.failure from error
                raise
        return self._host(grads)

    def construct(self, grads: Any) -> Any:
        """The compiled path (GRAPH_MODE, ``ms.jit``): one host call."""
        if self._refused:
            raise ValueError(self._refused)
        if self._scalars:
            grads = tuple([reshaped(grad, (1,)) if i in self._scalars and grad.ndim == 0
                           else grad for i, grad in enumerate(grads)])
        if self._keyed:
            outs = self._custom(self._key, *grads)
        else:
            outs = self._custom(*grads)
        if self._scalars:
            outs = tuple([reshaped(out, ()) if i in self._scalars else out
                          for i, out in enumerate(outs)])
        return outs


def _variable(grads: Tuple[Any, ...]) -> Any:
    """``grads`` as the compiled call's variable input: a plain tuple of tensors is a
    constant to MindSpore, so each step's new values would compile the graph again
    (0.1-0.3 s a step); ``ms.mutable`` marks it variable. Tuples holding row tensors,
    which ``mutable`` does not take, go as they are."""
    if all(isinstance(grad, ms.Tensor) for grad in grads):
        return ms.mutable(grads)
    return grads


class _Host:
    """The reduction itself, on one Reducer: PyNative calls on tensors, and
    the compiled step's host calls on arrays."""

    def __init__(self, parameters: Sequence[Any], mean: Optional[bool], degree: Optional[int],
                 fusion_type: int, group: Any, lookup_tables: Collection[Any],
                 options: Dict[str, Any]) -> None:
        error: Optional[Exception] = None
        settings: Dict[str, Any] = {}
        self.parameters = tuple(parameters)
        self._lookups: FrozenSet[int] = frozenset()
        try:
            check_launch()
            settings = _settings(self.parameters, mean, fusion_type)
            self._lookups = _positions(self.parameters, lookup_tables)
        except Exception as exc:     # raised on every rank, below
            error = exc
        with communicator(group) as comm:
            try:
                self.reducer = Reducer(comm, degree=degree,
                                       **{"sparse": "gather", **settings, **options})
            except Exception:
                if error is not None:    # the settings differ because of it: say why
                    raise error from None
                raise
        self.shapes = [tuple(p.shape) for p in self.parameters]
        self._skip = self.reducer.skip or (False,) * len(self.parameters)
        try:
            self.reducer.agree(error=error)
        except BaseException:
            self.reducer.free()
            raise

    def wait_for_launched_steps(self) -> None:
        """Return once every step launched so far has run: reading a
        parameter's value waits for MindSpore's pipeline."""
        if self.parameters:
            self.parameters[0].asnumpy()

    def __call__(self, grads: Sequence[Any]) -> Tuple[Any, ...]:
        """PyNative: the reduced tensors (see DistributedGradReducer.__call__)."""
        try:
            arrays = self._arrays(grads)
        except Exception as exc:
            self.reducer.agree(error=exc)
            raise                     # agree raised it already
        outs = self.reducer.reduce(arrays)
        return tuple(self._tensor(out, grad, index)
                     for index, (out, grad) in enumerate(zip(outs, grads)))

    def reduce_into(self, arrays: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> None:
        """The compiled step's host call on its own buffers (the aot op): the reduced
        gradients summed out of ``arrays`` straight into ``outputs`` (a lookup table's
        rows gathered, then written there; a skipped gradient copied as it came). A
        gradient whose shape or dtype is not its parameter's raises here and PeerError
        on the other ranks."""
        try:
            for index, (array, out) in enumerate(zip(arrays, outputs)):
                if array.shape != out.shape or array.dtype != out.dtype:
                    raise ValueError(
                        f"grads[{index}] ({self.parameters[index].name}): expecting the "
                        f"parameter's {out.dtype} {out.shape}, got {array.dtype} {array.shape}")
        except Exception as exc:
            self.reducer.agree(error=exc)
            raise                     # agree raised it already
        prepared = [self._prepared(index, array) for index, array in enumerate(arrays)]
        given = [None if isinstance(p, RowSparse) else out for p, out in zip(prepared, outputs)]
        results = self.reducer.reduce(prepared, out=given)
        for out, result in zip(outputs, results):
            if isinstance(result, RowSparse):
                np.copyto(out, result.to_dense())

    def reduce_arrays(self, arrays: Sequence[np.ndarray]) -> Tuple[np.ndarray, ...]:
        """The compiled step's host call: the reduced arrays (a lookup
        table's rows gathered, a skipped gradient as it came)."""
        prepared = [self._prepared(index, np.ascontiguousarray(array))
                    for index, array in enumerate(arrays)]
        outs = self.reducer.reduce(prepared)
        return tuple(out.to_dense() if isinstance(out, RowSparse) else out for out in outs)

    def _arrays(self, grads: Sequence[Any]) -> List[Any]:
        """Numpy views (or RowSparse) of ``grads``, checked against the parameters."""
        if not isinstance(grads, (tuple, list)) or len(grads) != len(self.parameters):
            got = f"{len(grads)}" if isinstance(grads, (tuple, list)) else type(grads).__name__
            raise ValueError(f"grads: expecting a tuple of {len(self.parameters)} gradients "
                             f"(one per parameter), got {got}")
        arrays: List[Any] = []
        for index, grad in enumerate(grads):
            if isinstance(grad, ROW_TENSORS):
                arrays.append(to_row_sparse(grad))
                continue
            if not isinstance(grad, ms.Tensor):
                raise TypeError(f"grads[{index}] ({self.parameters[index].name}): expecting a "
                                f"MindSpore Tensor or RowTensor, got {type(grad).__name__}")
            array = to_numpy(grad)
            if array.shape != self.shapes[index]:
                raise ValueError(
                    f"grads[{index}] ({self.parameters[index].name}): expecting the "
                    f"parameter's shape "
                    f"{self.shapes[index]}, got {array.shape}; a sparse lookup's gradient "
                    "in PyNative mode holds the looked-up rows without their indices: pass "
                    "a RowTensor(indices, values, shape), or look up with nn.Embedding and "
                    "name its table in lookup_tables")
            arrays.append(self._prepared(index, array))
        return arrays

    def _prepared(self, index: int, array: np.ndarray) -> Any:
        """What the Reducer takes for gradient ``index``: a lookup table's
        non-zero rows (RowSparse), else the array."""
        if index in self._lookups and not self._skip[index]:
            rows = np.flatnonzero(array.reshape(len(array), -1).any(axis=1))
            return RowSparse(rows, array[rows], array.shape)
        return array

    def _tensor(self, out: Any, grad: Any, index: int) -> Any:
        """``out`` as ``grad``'s kind."""
        if self._skip[index]:
            return grad
        if isinstance(grad, ROW_TENSORS):
            return to_row_tensor(out, grad)
        if isinstance(out, RowSparse):            # a lookup table's rows
            return to_tensor(out.to_dense())
        return to_tensor(out)


def _settings(parameters: Sequence[Any], mean: Optional[bool],
              fusion_type: int) -> Dict[str, Any]:
    """The Reducer's mean, split indices and skip flags, MindSpore's way."""
    if mean is None:
        mean = bool(ms.get_auto_parallel_context("gradients_mean"))
    if not isinstance(fusion_type, int) or isinstance(fusion_type, bool) or fusion_type < 0:
        raise ValueError(f"fusion_type: expecting an int >= 0, got {fusion_type!r}")
    skip = [bool(p.layerwise_parallel or p.param_info.is_in_pynative_shard
                 or getattr(p, "is_param_ps", False)) for p in parameters]
    return {"mean": mean, "split_indices": _split_indices(parameters, fusion_type),
            "skip": skip if any(skip) else None}


def _split_indices(parameters: Sequence[Any], fusion_type: int) -> Optional[List[int]]:
    """Fusion groups: where the parameters' ``comm_fusion`` changes; else the
    auto-parallel ``all_reduce_fusion_config`` (fusion_type 1); else none
    (one group) or, for fusion_type 0, every gradient alone."""
    fusion = [p.comm_fusion for p in parameters]
    changes = [i for i in range(1, len(fusion)) if fusion[i] != fusion[i - 1]]
    if changes:
        return changes
    configured = list(ms.get_auto_parallel_context("all_reduce_fusion_config") or ())
    if configured and fusion_type == 1:
        return configured
    if fusion_type == 0 and len(fusion) > 1:
        return list(range(1, len(fusion)))
    return None


def _positions(parameters: Sequence[Any], tables: Collection[Any]) -> FrozenSet[int]:
    """The positions of ``tables`` (parameters or names) among ``parameters``."""
    names = [p.name for p in parameters]
    positions = set()
    for table in tables:
        name = table if isinstance(table, str) else getattr(table, "name", None)
        if name not in names:
            raise ValueError(f"lookup_tables: expecting parameters (or names) among the "
                             f"reducer's, got {name!r}")
        positions.add(names.index(name))
    return frozenset(positions)



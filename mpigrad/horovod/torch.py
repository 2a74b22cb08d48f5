"""Horovod 0.28's ``horovod.torch`` API on mpigrad (CPU tensors):

    import mpigrad.horovod.torch as hvd      # was: import horovod.torch as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

Launch with ``mpiexec -n N python train.py`` (``horovodrun -np N`` is not
needed). Every collective is checked across ranks (a mismatch raises on every
rank) and watched (a stalled or lost rank ends every rank's wait with an
error naming it), as mpigrad's own; the differences from Horovod are listed in
docs/horovod.md.
"""

from typing import (Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type,
                    TypeVar, cast)

import numpy as np
import torch

from .. import torch as mgt
from .._engine.world import fault_tolerant, threads_supported
from .._base.arrays import numpy_from_torch, torch_from_numpy
from . import core
from . import torch_elastic as elastic
from .adasum_optimizer import AdasumOptimizer
from .core import (Adasum, Average, HorovodInternalError, Max, Min, Product, ProcessSet, Sum,
                   add_process_set, global_process_set, init, is_initialized, poll,
                   remove_process_set, shutdown)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "mpi_threads_supported", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "HorovodInternalError",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "sparse_allreduce_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
    "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "barrier", "join", "poll", "synchronize", "broadcast_object", "allgather_object",
    "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "elastic",
]


# -- the job ---------------------------------------------------------------------
def rank() -> int:
    return core.world().rank


def size() -> int:
    return core.world().size


def local_rank() -> int:
    return core.placement().local_rank


def local_size() -> int:
    return core.placement().local_size


def cross_rank() -> int:
    return core.placement().cross_rank


def cross_size() -> int:
    return core.placement().cross_size


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return threads_supported()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record the collectives of this layer into ``file_path``: a Chrome
    trace (chrome://tracing, Perfetto) in Horovod's layout, written by rank 0
    when the timeline stops (see mpigrad/horovod/timeline.py)."""
    core.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Write the timeline and stop recording."""
    core.stop_timeline()


# -- compression -------------------------------------------------------------------
class _NoneCompressor:
    """Tensors travel as they are."""

    #: what float32 sums travel as (mpigrad's wire; None: float32)
    wire: Optional[str] = None

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _HalfCompressor(_NoneCompressor):
    """A Horovod compressor to a half-precision dtype: ``compress`` casts a
    floating-point tensor to it (its ctx the tensor's dtype), ``decompress``
    casts back, as Horovod's do. mpigrad's own calls (allreduce,
    grouped_allreduce, DistributedOptimizer) do not cast: they send float32
    sums through ``wire`` (each rank's values rounded once, summed in float32,
    the sum rounded once), the tensors keeping their dtype."""

    half: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.to(cls.half), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class _FP16Compressor(_HalfCompressor):
    """Float32 sums travel as float16 (Horovod's casts the tensor and sums in float16)."""

    wire = "float16"
    half = torch.float16


class _BF16Compressor(_HalfCompressor):
    """Float32 sums travel as bfloat16, as ``fp16`` does as float16."""

    wire = "bfloat16"
    half = torch.bfloat16


class Compression:
    """Horovod's gradient compression: ``Compression.none``, ``Compression.fp16`` and
    ``Compression.bf16`` (half the bytes for float32 sums: allreduce, grouped_allreduce,
    DistributedOptimizer; other calls accept them and send the tensors as they are)."""

    none = _NoneCompressor
    fp16 = _FP16Compressor
    bf16 = _BF16Compressor


def _wire_of(compression: Any) -> Optional[str]:
    wire: Optional[str] = getattr(compression, "wire", None)
    return wire


def _compressed(compression: Any, tensors: Sequence[torch.Tensor]
                ) -> Tuple[List[torch.Tensor], Optional[List[Any]]]:
    """(what a call sends of ``tensors``, the ctxs to decompress them): the
    tensors as they are where nothing casts them (``Compression.none``, or one
    of mpigrad's wires: ctxs None), else each one's ``compress``."""
    if compression is Compression.none or _wire_of(compression) is not None:
        return list(tensors), None
    packed = [compression.compress(t) for t in tensors]
    return [t for t, _ in packed], [ctx for _, ctx in packed]


def _decompressed(compression: Any, tensors: Sequence[torch.Tensor],
                  ctxs: Optional[List[Any]]) -> List[torch.Tensor]:
    if ctxs is None:
        return list(tensors)
    return [compression.decompress(t, ctx) for t, ctx in zip(tensors, ctxs)]


class _Unrecorded:
    """The ctx of a Function's forward run without autograd (``_applied``): it
    keeps what forward stores on it; nothing is marked, as no graph is made."""

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        del tensors


_F = TypeVar("_F", bound=torch.autograd.Function)


def _applied(function: Type[_F], *args: Any) -> Any:
    """``function.apply(*args)`` where it records a gradient (autograd is on and a
    tensor among ``args`` requires grad), else its forward run as it is: the
    same results, without autograd's cost (20 us of a 100 us small allreduce
    here, and more per tensor of a grouped call)."""
    if torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return function.apply(*args)
    return function.forward(_Unrecorded(), *args)


# -- tensors as numpy buffers --------------------------------------------------------
def _cpu(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expecting a torch tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu:
        raise RuntimeError(f"{what}: mpigrad's Horovod layer takes CPU tensors, got one on "
                           f"{tensor.device}; move it with .cpu()")


def _dense(tensor: torch.Tensor, what: str) -> None:
    """A TypeError, or RuntimeError, unless ``tensor`` is a dense CPU tensor."""
    _cpu(tensor, what)
    if tensor.layout != torch.strided:
        raise TypeError(f"{what}: expecting dense tensors, got a {tensor.layout} one; reduce "
                        "sparse tensors with allreduce_async or sparse_allreduce_async "
                        "(not in place, not grouped)")


def _buffer(tensor: torch.Tensor) -> Tuple[torch.Tensor, np.ndarray]:
    """(a contiguous tensor of ``tensor``'s values: its memory where it is
    contiguous, a numpy view of it); detached only where it requires grad, each
    step asked first (a grouped call has hundreds of tensors)."""
    work = tensor.detach() if tensor.requires_grad else tensor
    if not work.is_contiguous():
        work = work.contiguous()
    return work, numpy_from_torch(work)


def _values(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of ``tensor``'s values (``_buffer``'s)."""
    return _buffer(tensor)[1]


def _as_tensors(arrays: Sequence[np.ndarray]) -> List[torch.Tensor]:
    """New tensors of a reduction's new arrays (sharing their memory)."""
    return [torch_from_numpy(a) for a in arrays]


def _op_of(average: Optional[bool], op: Optional[int]) -> int:
    if average is not None and op is not None:
        raise ValueError("average and op are mutually exclusive: pass op only")
    if op is not None:
        return op
    return Sum if average is False else Average


def _handle(pending: core.Handle) -> int:
    return core.handle_of(pending)


def synchronize(handle: int) -> Any:
    """Wait for an ``*_async`` call; return its result (the output tensor)."""
    return core.synchronize(handle)


# -- allreduce ----------------------------------------------------------------------
def _allreduce_into(tensors: Sequence[torch.Tensor], outputs: Optional[Sequence[torch.Tensor]],
                    op: int, prescale: float, postscale: float, name: Optional[str],
                    process_set: ProcessSet, wire: Optional[str] = None) -> core.Handle:
    """Reduce ``tensors`` into ``outputs`` (which may be the same tensors; None:
    new tensors)."""
    for t in (*tensors, *(outputs or ())):
        _dense(t, "allreduce")
    if outputs is None:
        return core.allreduce([_values(t) for t in tensors], None, op, prescale, postscale,
                              name, process_set, wire).then(_as_tensors)
    works = [_buffer(t) for t in outputs]
    inputs = [_values(t) if t is not o else w for t, o, (_, w) in zip(tensors, outputs, works)]

    def written(arrays: Any) -> Sequence[torch.Tensor]:
        for out, (work, _) in zip(outputs, works):
            if work.data_ptr() != out.data_ptr():
                with torch.no_grad():
                    out.copy_(work)
        return outputs
    return core.allreduce(inputs, [w for _, w in works], op, prescale, postscale, name,
                          process_set, wire).then(written)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[int] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` in place; a handle for ``synchronize``."""
    pending = _allreduce_into([tensor], [tensor], _op_of(average, op), prescale_factor,
                              postscale_factor, name, process_set)
    return _handle(pending.then(lambda outs: outs[0]))


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Optional[int] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` into a new tensor; a handle for ``synchronize``
    (a sparse tensor: ``sparse_allreduce_async``)."""
    if tensor.layout == torch.sparse_coo:
        if (prescale_factor, postscale_factor) != (1.0, 1.0):
            raise ValueError("allreduce of a sparse tensor: scale factors are not supported; "
                             "scale the values")
        return _handle(_sparse_allreduce(tensor, name, _op_of(average, op), process_set))
    return _allreduce_new(tensor, _op_of(average, op), prescale_factor, postscale_factor, name,
                          process_set)


def _allreduce_new(tensor: torch.Tensor, op: int, prescale: float, postscale: float,
                   name: Optional[str], process_set: ProcessSet,
                   wire: Optional[str] = None) -> int:
    pending = _allreduce_into([tensor], None, op, prescale, postscale, name, process_set, wire)
    return _handle(pending.then(lambda outs: outs[0]))


def _sparse_allreduce(tensor: torch.Tensor, name: Optional[str], op: int,
                      process_set: ProcessSet) -> core.Handle:
    """Start reducing the sparse COO ``tensor`` as Horovod does: every rank's
    entries gathered (duplicates add up), values averaged for Average; the
    pending result is the new sparse tensor."""
    _cpu(tensor, "sparse_allreduce")
    if tensor.layout != torch.sparse_coo:
        raise TypeError(f"sparse_allreduce: expecting a sparse COO tensor, got {tensor.layout}")
    coalesced = tensor.detach().coalesce()
    indices = numpy_from_torch(coalesced.indices().t().contiguous())
    values = numpy_from_torch(coalesced.values().contiguous())

    def built(result: Tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        rows, gathered = result
        # valid by construction: every rank's entries of the agreed dense shape
        return torch.sparse_coo_tensor(torch.from_numpy(rows).t(), torch_from_numpy(gathered),
                                       tuple(tensor.shape), check_invariants=False)
    return core.sparse_allreduce(indices, values, tuple(tensor.shape), op, name,
                                 process_set).then(built)


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str] = None,
                           op: int = Average,
                           process_set: ProcessSet = global_process_set
                           ) -> Callable[[], torch.Tensor]:
    """Start reducing the sparse COO ``tensor`` (every rank's entries
    gathered, duplicates added, averaged for Average); as Horovod's, returns
    a function that waits and gives the new sparse tensor
    (``allreduce_async`` of a sparse tensor gives a handle for ``synchronize``)."""
    return _sparse_allreduce(tensor, name, op, process_set).wait


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks, in place (Average by default)."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, prescale: float, postscale: float,
                name: Optional[str], process_set: ProcessSet, wire: Optional[str]
                ) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set, wire)
        return synchronize(_reduction(tensor, op, prescale, postscale, name, process_set, wire))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, prescale, postscale, process_set, wire = ctx.args
        return (synchronize(_reduction(grad, op, prescale, postscale, None, process_set, wire)),
                None, None, None, None, None, None)


def _reduction(tensor: torch.Tensor, op: int, prescale: float, postscale: float,
               name: Optional[str], process_set: ProcessSet, wire: Optional[str]) -> int:
    """allreduce_async's handle; through ``wire`` where one is given (dense tensors)."""
    if wire is None:
        return allreduce_async(tensor, None, name, op, prescale, postscale, process_set)
    return _allreduce_new(tensor, op, prescale, postscale, name, process_set, wire)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The reduction of ``tensor`` over the ranks, a new tensor (Average by
    default; Sum, Min, Max, Product); differentiable. ``Compression.fp16``/``bf16``:
    a float32 sum travels at half the bytes (mpigrad's wire)."""
    sent, ctxs = _compressed(compression, [tensor])
    summed = _applied(_Allreduce, sent[0], _op_of(average, op), prescale_factor,
                      postscale_factor, name, process_set, _wire_of(compression))
    return _decompressed(compression, [summed], ctxs)[0]


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensors`` in place as one fused, checked call."""
    tensors = list(tensors)
    return _handle(_allreduce_into(tensors, tensors, _op_of(average, op), prescale_factor,
                                   postscale_factor, name, process_set).then(list))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensors`` into new tensors as one fused, checked call."""
    return _grouped_new(tensors, _op_of(average, op), prescale_factor, postscale_factor, name,
                        process_set)


def _grouped_new(tensors: Sequence[torch.Tensor], op: int, prescale: float, postscale: float,
                 name: Optional[str], process_set: ProcessSet,
                 wire: Optional[str] = None) -> int:
    return _handle(_allreduce_into(list(tensors), None, op, prescale, postscale, name,
                                   process_set, wire).then(list))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[int] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: int, prescale: float, postscale: float, name: Optional[str],
                process_set: ProcessSet, wire: Optional[str], *tensors: torch.Tensor) -> Any:
        ctx.args = (op, prescale, postscale, process_set, wire)
        return tuple(synchronize(_grouped_new(tensors, op, prescale, postscale, name,
                                              process_set, wire)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, prescale, postscale, process_set, wire = ctx.args
        reduced = synchronize(_grouped_new(grads, op, prescale, postscale, None, process_set,
                                           wire))
        return (None, None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none,
                      op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """The reductions of ``tensors``, new tensors, in one fused checked call;
    differentiable (``compression``: as allreduce's)."""
    sent, ctxs = _compressed(compression, tensors)
    reduced = _applied(_GroupedAllreduce, _op_of(average, op), prescale_factor,
                       postscale_factor, name, process_set, _wire_of(compression), *sent)
    return _decompressed(compression, reduced, ctxs)


# -- allgather ----------------------------------------------------------------------
def _allgather_pending(tensor: torch.Tensor, name: Optional[str],
                       process_set: ProcessSet) -> core.Handle:
    _cpu(tensor, "allgather")
    return core.allgather(_values(tensor), name, process_set).then(
        lambda result: (torch_from_numpy(result[0]), result[1]))


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start gathering ``tensor`` from every rank along its first dimension."""
    return _handle(_allgather_pending(tensor, name, process_set).then(lambda r: r[0]))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str],
                process_set: ProcessSet) -> torch.Tensor:
        output, rows = _allgather_pending(tensor, name, process_set).wait()
        ctx.rows, ctx.process_set = rows, process_set
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Horovod's gradient: the average of the ranks' gradients, this rank's rows
        averaged = synchronize(allreduce_async(grad, None, None, Average, 1.0, 1.0,
                                               ctx.process_set))
        mine = ctx.process_set.rank()
        start = sum(ctx.rows[:mine])
        return averaged.narrow(0, start, ctx.rows[mine]), None, None


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (which
    may differ across ranks); differentiable."""
    return _applied(_Allgather, tensor, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """``allgather`` of each of ``tensors``, in order."""
    return [allgather(t, None if name is None else f"{name}.{i}", process_set)
            for i, t in enumerate(tensors)]


# -- broadcast ----------------------------------------------------------------------
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start overwriting ``tensor`` with ``root_rank``'s, in place."""
    _cpu(tensor, "broadcast")
    work, array = _buffer(tensor)

    def written(_: Any) -> torch.Tensor:
        if work.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(work)
        return tensor
    return _handle(core.broadcast(array, root_rank, name, process_set).then(written))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start broadcasting ``root_rank``'s ``tensor`` into a new tensor."""
    return broadcast_async_(tensor.detach().clone(memory_format=torch.contiguous_format),
                            root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str],
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Horovod's gradient: the ranks' average on the root, zeros elsewhere
        averaged = synchronize(allreduce_async(grad, None, None, Average, 1.0, 1.0,
                                               ctx.process_set))
        if rank() != ctx.root:
            averaged = averaged * 0
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor``, a new tensor on every rank; differentiable."""
    return _applied(_Broadcast, tensor, root_rank, name, process_set)


# -- alltoall ------------------------------------------------------------------------
def _splits_of(splits: Any) -> Optional[List[int]]:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"alltoall: expecting integer splits (int32), got {splits.dtype}")
        return [int(s) for s in splits.tolist()]
    return [int(s) for s in splits]


def _alltoall_pending(tensor: torch.Tensor, splits: Optional[List[int]], name: Optional[str],
                      process_set: ProcessSet) -> core.Handle:
    _cpu(tensor, "alltoall")
    return core.alltoall(_values(tensor), splits, name, process_set).then(
        lambda result: (torch_from_numpy(result[0]),
                        torch.tensor(result[1], dtype=torch.int32)))


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall; ``synchronize`` gives (output, received splits)."""
    return _handle(_alltoall_pending(tensor, _splits_of(splits), name, process_set))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Optional[List[int]],
                name: Optional[str], process_set: ProcessSet) -> Any:
        output, received = _alltoall_pending(tensor, splits, name, process_set).wait()
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> Any:
        back, _ = _alltoall_pending(grad, [int(s) for s in ctx.received.tolist()], None,
                                    ctx.process_set).wait()
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[r]`` rows of ``tensor`` to rank r (default: equal parts);
    the rows received, in rank order, and with ``splits`` given also the
    received splits (int32), as Horovod 0.28; differentiable."""
    output, received = _applied(_Alltoall, tensor, _splits_of(splits), name, process_set)
    return output if splits is None else (output, received)


# -- reducescatter ---------------------------------------------------------------------
def _reducescatter_pending(tensors: Sequence[torch.Tensor], op: int, prescale: float,
                           postscale: float, name: Optional[str],
                           process_set: ProcessSet) -> core.Handle:
    for t in tensors:
        _cpu(t, "reducescatter")
    arrays = [_values(t) for t in tensors]
    return core.reducescatter(arrays, op, prescale, postscale, name, process_set).then(
        lambda outs: [torch_from_numpy(out) for out in outs])


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None,
                        op: int = Average, process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    return _handle(_reducescatter_pending([tensor], op, prescale_factor, postscale_factor,
                                          name, process_set).then(lambda outs: outs[0]))


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: int, prescale: float, postscale: float, name: Optional[str],
                process_set: ProcessSet, *tensors: torch.Tensor) -> Any:
        ctx.args = (op, prescale * postscale, process_set)
        return tuple(_reducescatter_pending(tensors, op, prescale, postscale, name,
                                            process_set).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        # Horovod's gradient: the allgather of the ranks' gradients, times the
        # set's size for a sum, and the scale factors
        op, scale, process_set = ctx.args
        factor = scale * (process_set.size() if op == Sum else 1)
        back = [allgather(grad * factor if factor != 1 else grad, None, process_set)
                for grad in grads]
        return (None, None, None, None, None, *back)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: Any = Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """The reduction (Average or Sum) of ``tensor`` over the ranks, of which
    rank r keeps its rows of the first dimension (the first n % p ranks one
    more); differentiable."""
    return grouped_reducescatter([tensor], name, compression, op, process_set,
                                 prescale_factor, postscale_factor)[0]


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Any = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """``reducescatter`` of each of ``tensors``, in one checked call."""
    sent, ctxs = _compressed(compression, tensors)
    out = _applied(_Reducescatter, op, prescale_factor, postscale_factor, name, process_set,
                   *sent)
    return _decompressed(compression, out, ctxs)


# -- the rest -------------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` gets here."""
    core.barrier(process_set)


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """This rank is out of data: it takes part in the others' allreduces with
    zeros (averages still divide by every rank) until all have joined;
    returns the rank that joined last. ``device`` is ignored (CPU)."""
    return core.join(process_set)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s (a rank of the job in ``process_set``) picklable
    ``obj`` on every rank of the set."""
    return core.broadcast_object(obj, root_rank, process_set, name)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Every rank's picklable ``obj``, in rank order."""
    return core.allgather_object(obj, process_set, name)


# -- the optimizer and the broadcasts of training state ------------------------------
def _checked_names(optimizer: torch.optim.Optimizer,
                   named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]]
                   ) -> Optional[List[Tuple[str, torch.Tensor]]]:
    """``named_parameters`` as a list, after Horovod's checks: unique names,
    every parameter of the optimizer named."""
    if named_parameters is None:
        return None
    named = list(named_parameters)
    if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in named):
        raise ValueError("named_parameters: expecting (name, parameter) pairs, as "
                         "model.named_parameters() gives")
    names = [name for name, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"named_parameters: parameter names must be unique, got "
                         f"{', '.join(dups)} more than once")
    ids = {id(p) for _, p in named}
    unnamed = [p for group in optimizer.param_groups for p in group["params"]
               if id(p) not in ids]
    if unnamed:
        raise ValueError(f"named_parameters was given, but {len(unnamed)} of the optimizer's "
                         "parameters are not named in it; name them all, or pass none")
    return named


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Horovod's ``DistributedOptimizer``: mpigrad.torch.DistributedOptimizer
    (gradients reduced as backward finishes them, in fused buckets, checked
    and watched; sparse gradients gathered as row-sparse unless
    ``sparse_as_dense``). ``op`` is Average (the mean) or Sum; Adasum
    steps each rank's optimizer on its own gradients and moves every rank by
    the Adasum of the parameter deltas (adasum_optimizer.py).
    ``compression``: Compression.fp16/bf16 send float32 gradients through
    mpigrad's wire (Reducer(wire=...): half the bytes, summed in float32).
    ``gradient_predivide_factor``, ``num_groups`` and ``groups`` are
    accepted: mpigrad fuses by size (its mean equals the predivided one).
    On a rank outside ``process_set`` it steps on this rank's own gradients,
    as Horovod's (a one-rank group: nothing moves, ``synchronize`` returns)."""
    named = _checked_names(optimizer, named_parameters)
    if op == Adasum:            # each rank steps alone; the deltas are combined
        return cast(torch.optim.Optimizer, AdasumOptimizer(
            optimizer, lambda deltas: grouped_allreduce(deltas, op=Adasum,
                                                        process_set=process_set)))
    if op not in (Average, Sum):
        raise ValueError(f"op: expecting hvd.Average, hvd.Sum or hvd.Adasum, got {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average")
    # launched with fault tolerance: a lost rank shrinks the job (hvd.elastic)
    shrink: Dict[str, Any] = {"on_failure": "shrink"} if fault_tolerant() else {}
    return mgt.DistributedOptimizer(optimizer, backward_passes_per_step=backward_passes_per_step,
                                    named_parameters=named, sparse_as_dense=sparse_as_dense,
                                    mean=op == Average, comm=process_set.reducing_communicator(),
                                    wire=_wire_of(compression), **shrink)


def broadcast_parameters(params: Any, root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` (a state_dict, named_parameters() pairs, or
    tensors) with ``root_rank``'s (a rank of the job in ``process_set``), in place."""
    with torch.no_grad():
        core.broadcast_tree(mgt.parameter_tree(params), root_rank, process_set)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: ProcessSet = global_process_set) -> None:
    """Give every rank of ``process_set`` ``root_rank``'s (a rank of the job
    in the set) optimizer state and options, as ``load_state_dict`` restores them."""
    mine = optimizer.state_dict() if rank() == root_rank else None
    optimizer.load_state_dict(core.broadcast_object(mine, root_rank, process_set))


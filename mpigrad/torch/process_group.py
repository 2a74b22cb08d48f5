"""torch.distributed on mpigrad: a ``ProcessGroup`` whose collectives are
mpigrad's checked and watched calls (registered as the backend "mpigrad" by
mpigrad.torch.backend).

Every collective of a group goes through one Communicator: the local checks
(CPU tensors, contiguous, a dtype the op takes), then one agreement naming
what each rank is about to do (the collective, op, root, dtypes and shapes),
so a rank that calls something else raises on every rank instead of
hanging; then the data moves, watched. Sums of floating-point tensors
(all_reduce, its coalesced form, reduce_scatter) of 64 KiB or more are then
handed to mpigrad's engine (a Reducer on the group: node memory and
cross-memory sums); smaller ones, the other ops and the data movements are
MPI's own collectives of the group. Either way half precision is summed in
float32 and AVG is the engine's one mean.

A group's calls run one after another, in the order they were made, on a thread of
its own (the group's worker), so that a Work returned to torch can still be running:
DDP's bucket all_reduces go on behind the rest of backward (whose kernels release the
GIL), and ``wait`` (or the Work's future) raises what the call raised. A call made
without ``async_op`` waits for it at once, as torch's front end does.
"""

import queue
import threading
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .._base.arrays import numpy_from_torch
from .._engine.collective import Communicator, Description, checked, mpi_datatype
from .._engine.settle import mean_factor, settle
from .._base.settings import reproducible_setting
from ..reducer import Reducer

__all__ = ["MpiProcessGroup"]

_SUMS = {"SUM": False, "AVG": True}          # the op's name -> the Reducer's mean
_MPI_OPS = {"SUM": MPI.SUM, "MIN": MPI.MIN, "MAX": MPI.MAX, "PRODUCT": MPI.PROD,
            "BAND": MPI.BAND, "BOR": MPI.BOR, "BXOR": MPI.BXOR}
_BITWISE = ("BAND", "BOR", "BXOR")
_HALF = (torch.float16, torch.bfloat16)
#: sums of at least this many bytes go through the engine (node sums pay off
#: there); smaller ones are one MPI Allreduce after the agreement
_ENGINE_BYTES = 1 << 16


def _op_name(op: Any) -> str:
    """"SUM", "AVG", ... of a ReduceOp (or its RedOpType)."""
    kind = getattr(op, "op", op)
    return str(getattr(kind, "name", kind)).rsplit(".", 1)[-1]


class _Done(dist.Work):
    """A completed collective, as torch's Work: ``wait`` returns at once and
    the future holds the call's tensors."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self.future: torch.futures.Future = torch.futures.Future()
        self.future.set_result(result)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class _Queued(dist.Work):
    """A call queued on the group's worker, as torch's Work: ``wait`` waits for it and
    raises what it raised; the future completes with it."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self.future = future

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self.future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return bool(self.future.done())

    def is_success(self) -> bool:
        if not self.future.done():
            return False
        try:
            self.future.value()
        except Exception:
            return False
        return True


class _Worker:
    """The thread that runs a group's calls one after another, in the order made (the
    order every rank makes them: MPI's rule for a communicator)."""

    def __init__(self, name: str) -> None:
        self.calls: "queue.Queue[Optional[Tuple[Callable[[], Any], torch.futures.Future]]]" = \
            queue.Queue()
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"mpigrad group {name}")
        self.thread.start()

    def submit(self, call: Callable[[], Any]) -> torch.futures.Future:
        """Queue ``call``; its future holds what it returns, or what it raised."""
        future: torch.futures.Future = torch.futures.Future()
        self.calls.put((call, future))
        return future

    def stop(self) -> None:
        """Finish the queued calls, then end the thread."""
        self.calls.put(None)
        self.thread.join()

    def _serve(self) -> None:
        while True:
            item = self.calls.get()
            if item is None:
                return
            call, future = item
            try:
                result = call()
            except BaseException as exc:         # the caller's wait raises it
                future.set_exception(exc)
            else:
                future.set_result(result)


def _host(tensor: Any, what: str) -> np.ndarray:
    """A numpy view of a CPU, contiguous tensor (flat); an error naming
    ``what`` otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expecting a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise NotImplementedError(
            f"{what}: expecting a CPU tensor, got one on {tensor.device}: the mpigrad backend "
            "reduces CPU tensors (init_process_group('mpigrad') with CPU models; for GPUs, "
            "use the nccl backend)")
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: expecting a contiguous tensor, got strides "
                         f"{tuple(tensor.stride())}: pass tensor.contiguous()")
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return numpy_from_torch(tensor.detach()).reshape(-1)


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint8)


def _unpack(received: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    """Copy consecutive pieces of the bytes ``received`` into ``arrays``,
    each as many bytes as it holds."""
    offset = 0
    for array in arrays:
        _bytes(array)[...] = received[offset:offset + array.nbytes]
        offset += array.nbytes


def _item(tensor: Any) -> str:
    return f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}" \
        if isinstance(tensor, torch.Tensor) else type(tensor).__name__


#: torch's stubs type ProcessGroup's methods by the front end's overloads; a
#: backend's are called by torch with (tensors, options), as overridden here
_Base: Any = dist.ProcessGroup


class MpiProcessGroup(_Base):
    """A torch ``ProcessGroup`` over an mpi4py communicator (see the module).

    Args:
        comm: the group's ranks, as an mpi4py Intracomm.
        timeout: seconds a collective may take before the job is aborted
            with a diagnostic naming the rank that did not come.
        name: the group's name, as torch knows it.
    """

    def __init__(self, comm: MPI.Intracomm, timeout: Optional[float], name: str) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self.comm = comm
        self.timeout = timeout
        self.group = name
        self.calls = Communicator(comm, timeout=timeout)
        self.reducers: Dict[bool, Reducer] = {}     # by mean: SUM and AVG
        with self.calls.call():     # the watch keeps the group's own for its notices
            self.p2p = self.calls.split("the mpigrad backend's point-to-point communicator")
        self.worker = _Worker(name)

    def run(self, call: Callable[[], Any]) -> Any:
        """``call()`` on the group's worker, after the calls queued before it; its
        result (or its error, raised here)."""
        return self.worker.submit(call).wait()

    # -- torch's questions -------------------------------------------------
    def getBackendName(self) -> str:
        return "mpigrad"

    @property
    def group_name(self) -> str:
        return self.group

    def name(self) -> str:
        return "mpigrad"

    # -- the one checked call ----------------------------------------------
    def _checked(self, kind: str, settings: Tuple[Tuple[str, Any], ...],
                 local: Callable[[], Tuple[Any, ...]], move: Callable[[Any], None],
                 result: Any) -> dist.Work:
        """``local()`` (its checks; what it returns goes to ``move``) and the
        agreement on ``kind``, ``settings`` and the items ``local`` names
        first in what it returns; then ``move`` the data; a completed Work."""
        def run() -> Any:
            with self.calls.call():
                with checked(self.calls) as call:
                    items, *prepared = local()
                    call.propose(Description(kind, settings, tuple(items), noun="tensor"))
                move(prepared)
            return result
        return _Queued(self.worker.submit(run))

    def _start(self, name: str, args: Sequence[Any], what: str) -> None:
        self.calls.collective(name, args, f"{what} (torch.distributed, mpigrad backend)")

    def _reducer(self, mean: bool) -> Reducer:
        """The group's Reducer for SUM (mean False) or AVG (made collectively
        on first use, inside a call every rank makes)."""
        if mean not in self.reducers:
            self.reducers[mean] = Reducer(self.comm, mean=mean, timeout=self.timeout)
        return self.reducers[mean]

    # -- reductions --------------------------------------------------------
    def _reduce(self, kind: str, tensors: Sequence[Any], arrays: Sequence[np.ndarray],
                op_name: str, root: Optional[int] = None) -> None:
        """The data movement of an (all_)reduce of ``tensors`` (``arrays``:
        their host views) in place: large float sums through the engine, and
        every float sum where its Reducer is exact (MPIGRAD_REPRODUCIBLE=1)."""
        if op_name in _SUMS and root is None and all(
                t.dtype.is_floating_point for t in tensors) and (
                sum(a.nbytes for a in arrays) >= _ENGINE_BYTES
                or reproducible_setting(None)):
            self._reducer(_SUMS[op_name]).reduce(list(tensors), inplace=True)
            return
        for tensor, array in zip(tensors, arrays):
            self._reduce_one(kind, tensor, array, op_name, root)

    def _reduce_one(self, kind: str, tensor: Any, array: np.ndarray, op_name: str,
                    root: Optional[int]) -> None:
        wire = array
        if tensor.dtype in _HALF or tensor.dtype == torch.bool:
            wire = (array.astype(np.float32) if tensor.dtype in _HALF
                    else array.view(np.uint8).copy())
        op = _MPI_OPS["SUM" if op_name == "AVG" else op_name]
        datatype = mpi_datatype(wire.dtype)
        if root is None:
            self._start("Allreduce", (MPI.IN_PLACE, [wire, datatype], op), kind)
        elif self.calls.rank == root:
            self._start("Reduce", (MPI.IN_PLACE, [wire, datatype], op, root), kind)
        else:
            self._start("Reduce", ([wire, datatype], None, op, root), kind)
        if root is not None and self.calls.rank != root:
            return
        if op_name == "AVG":                    # the one mean, as the engine's
            settle(wire, mean_factor(wire.dtype, self.calls.size))
        if wire is not array:
            array[...] = wire.astype(array.dtype) if tensor.dtype != torch.bool \
                else wire.view(np.bool_)

    def _check_op(self, tensors: Sequence[Any], op_name: str, what: str) -> List[np.ndarray]:
        """The tensors' host views; an error where the op cannot take them."""
        if op_name not in _MPI_OPS and op_name != "AVG":
            raise NotImplementedError(
                f"{what}: op {op_name} is not supported by the mpigrad backend: expecting SUM, "
                "AVG, MIN, MAX, PRODUCT, BAND, BOR or BXOR (for PREMUL_SUM, scale the "
                "tensor and use SUM)")
        arrays = []
        for i, tensor in enumerate(tensors):
            array = _host(tensor, f"{what} tensor {i}")
            floating = tensor.dtype.is_floating_point or tensor.is_complex()
            if op_name in _BITWISE and floating:
                raise TypeError(f"{what}: {op_name} needs integer or bool tensors, got "
                                f"{tensor.dtype}")
            if op_name == "AVG" and not floating:
                raise TypeError(f"{what}: AVG needs floating-point tensors, got "
                                f"{tensor.dtype}: use SUM and divide")
            if tensor.dtype == torch.bool and op_name in ("SUM", "PRODUCT"):
                raise TypeError(f"{what}: {op_name} of bool tensors is not defined here: "
                                "use MAX (any) or MIN (all)")
            if tensor.is_complex() and op_name in ("MIN", "MAX", "PRODUCT"):
                raise TypeError(f"{what}: {op_name} of complex tensors is not defined")
            arrays.append(array)
        return arrays

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        op_name = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._checked(
            "all_reduce", (("op", op_name),),
            lambda: ([_item(t) for t in tensors], self._check_op(tensors, op_name, "all_reduce")),
            lambda prepared: self._reduce("Allreduce of all_reduce", tensors, prepared[0],
                                          op_name), tensors)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        op_name = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._checked(
            "all_reduce_coalesced", (("op", op_name),),
            lambda: ([_item(t) for t in tensors],
                     self._check_op(tensors, op_name, "all_reduce_coalesced")),
            lambda prepared: self._reduce("Allreduce of all_reduce_coalesced", tensors,
                                          prepared[0], op_name), tensors)

    def reduce(self, tensors: Any, opts: Any) -> dist.Work:
        op_name, root = _op_name(opts.reduceOp), opts.rootRank

        def local() -> Tuple[Any, ...]:
            self._root(root, "reduce")
            return ([_item(t) for t in tensors], self._check_op(tensors, op_name, "reduce"))
        return self._checked("reduce", (("op", op_name), ("root", root)), local,
                             lambda prepared: self._reduce("Reduce of reduce", tensors, prepared[0],
                                                           op_name, root), tensors)

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any) -> dist.Work:
        """Each rank's output: the reduction of every rank's inputs[rank]."""
        op_name = _op_name(opts.reduceOp)
        output, chunks = outputs[0], inputs[0]

        def local() -> Tuple[Any, ...]:
            if len(chunks) != self.calls.size:
                raise ValueError(f"reduce_scatter: expecting {self.calls.size} input tensors "
                                 f"(one per rank), got {len(chunks)}")
            for i, chunk in enumerate(chunks):
                if chunk.shape != output.shape or chunk.dtype != output.dtype:
                    raise ValueError(f"reduce_scatter: input {i} is {_item(chunk)}, expecting "
                                     f"the output's {_item(output)}")
            self._check_op([output, *chunks], op_name, "reduce_scatter")
            return ([_item(output)],)
        return self._checked("reduce_scatter", (("op", op_name),), local,
                             lambda _: self._reduce_scatter(torch.cat(
                                 [c.detach().reshape(-1) for c in chunks]), output, op_name),
                             outputs)

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any) -> dist.Work:
        """``output`` gets this rank's 1/p of the reduction of ``input``."""
        op_name = _op_name(opts.reduceOp)

        def local() -> Tuple[Any, ...]:
            self._check_op([output, input], op_name, "reduce_scatter_tensor")
            if input.numel() != output.numel() * self.calls.size or input.dtype != output.dtype:
                raise ValueError(f"reduce_scatter_tensor: expecting an input of "
                                 f"{self.calls.size} x the output's {output.numel()} elements "
                                 f"of {output.dtype}, got {_item(input)}")
            return ([_item(output), _item(input)],)
        return self._checked("reduce_scatter_tensor", (("op", op_name),), local,
                             lambda _: self._reduce_scatter(input.detach().reshape(-1).clone(),
                                                            output, op_name), output)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter(self, whole: Any, output: Any, op_name: str) -> None:
        """Reduce all of ``whole`` in place (a flat copy of the inputs: the
        caller's stay as they are), keep this rank's part in ``output``."""
        self._reduce("Allreduce of reduce_scatter", [whole], [_host(whole, "reduce_scatter")],
                     op_name)
        n = output.numel()
        output.detach().reshape(-1).copy_(whole[self.calls.rank * n:(self.calls.rank + 1) * n])

    # -- data movement -----------------------------------------------------
    def _root(self, root: int, what: str) -> None:
        if not isinstance(root, int) or not 0 <= root < self.calls.size:
            raise ValueError(f"{what}: expecting a root rank in [0, {self.calls.size}) of the "
                             f"group, got {root!r}")

    def broadcast(self, tensors: Any, opts: Any) -> dist.Work:
        root = opts.rootRank

        def local() -> Tuple[Any, ...]:
            self._root(root, "broadcast")
            return ([_item(t) for t in tensors], [_host(t, "broadcast") for t in tensors])

        def move(prepared: Any) -> None:
            for array in prepared[0]:
                self._start("Bcast", ([_bytes(array), MPI.BYTE], root), "Bcast of broadcast")
        return self._checked("broadcast", (("root", root),), local, move, tensors)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        """outputs[0][r] gets rank r's inputs[0]."""
        output_list, tensor = outputs[0], inputs[0]

        def local() -> Tuple[Any, ...]:
            self._each_like(output_list, tensor, "all_gather")
            return ([_item(tensor)], _host(tensor, "all_gather"))

        def move(prepared: Any) -> None:
            gathered = np.empty(prepared[0].nbytes * self.calls.size, np.uint8)
            self._start("Allgather", ([_bytes(prepared[0]), MPI.BYTE], [gathered, MPI.BYTE]),
                        "Allgather of all_gather")
            _unpack(gathered, [_host(out, "all_gather") for out in output_list])
        return self._checked("all_gather", (), local, move, outputs)

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> dist.Work:
        """``output`` (p x the input's elements) gets every rank's input in
        rank order (the input may alias this rank's part of it)."""
        def local() -> Tuple[Any, ...]:
            if output.numel() != input.numel() * self.calls.size or output.dtype != input.dtype:
                raise ValueError(f"all_gather_into_tensor: expecting an output of "
                                 f"{self.calls.size} x the input's {input.numel()} elements of "
                                 f"{input.dtype}, got {_item(output)}")
            return ([_item(input)], _host(input, "all_gather_into_tensor").copy(),
                    _host(output, "all_gather_into_tensor"))

        def move(prepared: Any) -> None:
            send, recv = prepared
            self._start("Allgather", ([_bytes(send), MPI.BYTE], [_bytes(recv), MPI.BYTE]),
                        "Allgather of all_gather_into_tensor")
        return self._checked("all_gather_into_tensor", (), local, move, output)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        for output_list, tensor in zip(outputs, inputs):
            self.allgather([output_list], [tensor], opts).wait()
        return _Done(outputs)

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any,
                                        opts: Any = None) -> dist.Work:
        for output, tensor in zip(outputs, inputs):
            self.all_gather_single(output, tensor, opts).wait()
        return _Done(outputs)

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any,
                                        opts: Any) -> dist.Work:
        for output, tensor in zip(outputs, inputs):
            self.reduce_scatter_single(output, tensor, opts).wait()
        return _Done(outputs)

    def gather(self, outputs: Any, inputs: Any, opts: Any) -> dist.Work:
        root, tensor = opts.rootRank, inputs[0]
        mine = self.calls.rank == root

        def local() -> Tuple[Any, ...]:
            self._root(root, "gather")
            if mine:
                self._each_like(outputs[0], tensor, "gather")
            return ([_item(tensor)], _host(tensor, "gather"))

        def move(prepared: Any) -> None:
            n = prepared[0].nbytes
            gathered = np.empty(n * self.calls.size if mine else 0, np.uint8)
            self._start("Gather", ([_bytes(prepared[0]), MPI.BYTE],
                                   [gathered, MPI.BYTE] if mine else None, root),
                        "Gather of gather")
            if mine:
                _unpack(gathered, [_host(out, "gather") for out in outputs[0]])
        return self._checked("gather", (("root", root),), local, move, outputs)

    def scatter(self, outputs: Any, inputs: Any, opts: Any) -> dist.Work:
        root, tensor = opts.rootRank, outputs[0]
        mine = self.calls.rank == root

        def local() -> Tuple[Any, ...]:
            self._root(root, "scatter")
            if mine:
                self._each_like(inputs[0], tensor, "scatter")
            return ([_item(tensor)], _host(tensor, "scatter"))

        def move(prepared: Any) -> None:
            send = np.concatenate([_bytes(_host(t, "scatter")) for t in inputs[0]]) \
                if mine else None
            self._start("Scatter", ([send, MPI.BYTE] if mine else None,
                                    [_bytes(prepared[0]), MPI.BYTE], root), "Scatter of scatter")
        return self._checked("scatter", (("root", root),), local, move, outputs)

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        """outputs[r] gets rank r's inputs[this rank] (any sizes)."""
        def local() -> Tuple[Any, ...]:
            for what, tensors in (("output", outputs), ("input", inputs)):
                if len(tensors) != self.calls.size:
                    raise ValueError(f"all_to_all: expecting {self.calls.size} {what} tensors "
                                     f"(one per rank), got {len(tensors)}")
            dtypes = {t.dtype for t in [*outputs, *inputs]}
            if len(dtypes) != 1:
                raise TypeError(f"all_to_all: expecting one dtype, got {sorted(map(str, dtypes))}")
            return ([str(next(iter(dtypes)))],
                    [_host(t, "all_to_all") for t in inputs],
                    [_host(t, "all_to_all") for t in outputs])

        return self._checked("all_to_all", (), local, self._alltoallv, outputs)

    def all_to_all_single(self, output: Any, input: Any, output_splits: Sequence[int],
                          input_splits: Sequence[int], opts: Any = None) -> dist.Work:
        """Rows of ``input`` split by ``input_splits`` (equal parts when
        empty) go to the ranks in order; ``output`` gets theirs likewise."""
        def parts(tensor: Any, splits: Sequence[int], what: str) -> List[np.ndarray]:
            rows = tensor.shape[0] if tensor.dim() else 1
            splits = list(splits) or [rows // self.calls.size] * self.calls.size
            if len(splits) != self.calls.size or sum(splits) != rows:
                raise ValueError(f"all_to_all_single: expecting {self.calls.size} {what} splits "
                                 f"summing to {rows} rows, got {list(splits)}")
            flat, row = _host(tensor, "all_to_all_single"), tensor[0].numel() if rows else 0
            bounds = np.cumsum([0, *splits]) * row
            return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

        def local() -> Tuple[Any, ...]:
            if output.dtype != input.dtype:
                raise TypeError(f"all_to_all_single: expecting one dtype, got {input.dtype} "
                                f"and {output.dtype}")
            return ([str(input.dtype)], parts(input, input_splits, "input"),
                    parts(output, output_splits, "output"))

        return self._checked("all_to_all_single", (), local, self._alltoallv, output)

    def _alltoallv(self, prepared: Any) -> None:
        """Each of the send arrays to its rank, each receive array from its."""
        sends, recvs = prepared
        send = np.concatenate([_bytes(a) for a in sends])
        send_counts, recv_counts = [a.nbytes for a in sends], [a.nbytes for a in recvs]
        recv = np.empty(sum(recv_counts), np.uint8)
        self._start("Alltoallv", ([send, (send_counts, None), MPI.BYTE],
                                  [recv, (recv_counts, None), MPI.BYTE]), "Alltoallv of all_to_all")
        _unpack(recv, recvs)

    def _each_like(self, tensors: Sequence[Any], like: Any, what: str) -> None:
        if len(tensors) != self.calls.size:
            raise ValueError(f"{what}: expecting {self.calls.size} tensors (one per rank), got "
                             f"{len(tensors)}")
        for i, t in enumerate(tensors):
            if t.shape != like.shape or t.dtype != like.dtype:
                raise ValueError(f"{what}: tensor {i} is {_item(t)}, expecting {_item(like)}")

    # -- synchronisation and point-to-point --------------------------------
    def barrier(self, opts: Any = None) -> dist.Work:
        return self._checked("barrier", (), lambda: ([],),
                             lambda _: self._start("Barrier", (), "barrier"), None)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names a rank that does not come (every barrier of
        this backend does: after the group's timeout)."""
        self.barrier().wait()

    def send(self, tensors: Any, dst: int, tag: int = 0) -> dist.Work:
        return self._point_to_point("Send", tensors, dst, tag, f"send to rank {dst}")

    def recv(self, tensors: Any, src: int, tag: int = 0) -> dist.Work:
        return self._point_to_point("Recv", tensors, src, tag, f"recv from rank {src}")

    def _point_to_point(self, name: str, tensors: Any, peer: int, tag: int,
                        what: str) -> dist.Work:
        arrays = [_host(tensor, what.split()[0]) for tensor in tensors]

        def run() -> Any:
            for array in arrays:
                self.calls.wait(self.calls.start(name, ([_bytes(array), MPI.BYTE], peer, tag),
                                                 f"{what} (tag {tag})", self.p2p))
            return tensors
        return _Queued(self.worker.submit(run))

    def shutdown(self) -> None:
        """Free the group's communicators and Reducers (destroy_process_group),
        once the calls queued before are done."""
        self.worker.stop()
        for reducer in self.reducers.values():
            reducer.free()
        self.reducers.clear()
        self.calls.free()

"""torch.distributed on mpigrad: a ``ProcessGroup`` whose collectives are
mpigrad's checked and watched calls (registered as the backend "mpigrad" by
mpigrad.torch.backend).

Each collective is translated into the engine's one typed collective
(mpigrad._collective.Collective: the kind, the op, the tensors' host views,
the root, one line per tensor) after the local checks (CPU tensors,
contiguous, a dtype the op takes), and run by the group's Group: one
agreement naming what each rank is about to do, so a rank that calls
something else raises on every rank instead of hanging; then the data moves,
watched. Sums of floating-point tensors (all_reduce, its coalesced form,
reduce_scatter) of 64 KiB or more are the engine's reductions (node memory
and cross-memory sums), whose agreement is the call's one; half precision is
summed in float32 and AVG is the engine's one mean, whatever the size.

A group's calls run on its worker (mpigrad.torch.worker): collectives one
after another in the order made, messages posted in that order and completed
beside them; ``wait`` (or the Work's future) raises what the call raised. A
call made without ``async_op`` waits for it at once, as torch's front end
does. The group's calls are opaque to dynamo (a graph break under
torch.compile, as at gloo's C++ group), and a call past the group's timeout
raises TimedOut (the group unusable from then on), as gloo's do.
"""

import functools
import operator
from datetime import timedelta
from typing import (Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple,
                    TypeVar, Union, cast)

import numpy as np
import torch
import torch.distributed as dist

from .._base.arrays import numpy_from_torch, torch_from_numpy
from .._base.settings import resolve_timeout
from .._collective import Collective, Group, Kept, Kind, Request
from .._collective.ops import TORCH, check_op
from .worker import Done, Worker

__all__ = ["MpiProcessGroup", "watch_seconds"]

#: torch's ReduceOp names -> the op table's
_OPS = {spelled: op for op, spelled in TORCH.spelled.items()}


def watch_seconds(timeout: Optional[timedelta]) -> Optional[float]:
    """A group's watch limit: torch's ``timeout`` for it, or MPIGRAD_TIMEOUT
    where that is shorter (or torch gives none)."""
    seconds = timeout.total_seconds() if timeout is not None else None
    mine = resolve_timeout()
    return mine if seconds is None else seconds if mine is None else min(seconds, mine)


#: the tag of monitored_barrier's messages (a user's messages should leave it free)
_MONITOR_TAG = (1 << 15) - 1


def _op_name(op: Any) -> str:
    """"SUM", "AVG", ... of a ReduceOp (or its RedOpType)."""
    if op == _SUM:                    # (most calls: a compare, where hashing torch's
        return "SUM"                  # enum for the table costs 0.9 us)
    kind = getattr(op, "op", op)
    name = _OP_NAMES.get(kind)
    if name is None:
        name = _OP_NAMES[kind] = str(getattr(kind, "name", kind)).rsplit(".", 1)[-1]
    return name


#: the names of the RedOpTypes met (every reduction asks)
_OP_NAMES: Dict[Any, str] = {}
_SUM = dist.ReduceOp.SUM


def _host(tensor: Any, what: str, index: Optional[int] = None) -> np.ndarray:
    """A numpy view of a CPU, contiguous tensor (flat); an error naming
    ``what`` (its tensor ``index``, where given) otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{_named(what, index)}: expecting a torch.Tensor, got "
                        f"{type(tensor).__name__}")
    if not tensor.is_cpu:
        raise NotImplementedError(
            f"{_named(what, index)}: expecting a CPU tensor, got one on {tensor.device}: the "
            "mpigrad backend reduces CPU tensors (init_process_group('mpigrad') with CPU "
            "models; for GPUs, use the nccl backend)")
    if not tensor.is_contiguous():
        raise ValueError(f"{_named(what, index)}: expecting a contiguous tensor, got strides "
                         f"{tuple(tensor.stride())}: pass tensor.contiguous()")
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    array = numpy_from_torch(tensor.detach() if tensor.requires_grad else tensor)
    return array if array.ndim == 1 else array.reshape(-1)


def _any_sparse(tensors: Sequence[Any]) -> bool:
    """Whether any of ``tensors`` is a sparse torch tensor."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_sparse:
            return True
    return False


def _named(what: str, index: Optional[int]) -> str:
    return what if index is None else f"{what} tensor {index}"


def _item(tensor: Any) -> str:
    return f"{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}" \
        if isinstance(tensor, torch.Tensor) else type(tensor).__name__


def _items(tensors: Sequence[Any]) -> Tuple[str, ...]:
    return tuple(_item(t) for t in tensors)


#: the signatures whose Collectives a group keeps before it forgets them all
_KEPT_TEMPLATES = 1024


_R = TypeVar("_R", bound=Union[Collective, Kept])


def _requested(translate: Callable[[], _R]) -> Union[_R, Exception]:
    """``translate()``, or the local error (a bad tensor, op or root) that
    kept it from making the Collective: raised on this rank and PeerError on
    the others, in the call's agreement, instead of here."""
    try:
        return translate()
    except Exception as exc:
        return exc


#: the bytes of a call that runs on the caller's thread where the group's worker is idle
#: (no hand-off: a small call's cost is the hand-off's); larger ones, DDP's buckets among
#: them, run on the worker while the caller goes on (backward's kernels)
SMALL_BYTES = 64 << 10


def _small(request: Union[Request, Kept]) -> bool:
    """Whether ``request`` is small enough to run on the caller's thread."""
    return isinstance(request, Exception) or \
        sum(map(_NBYTES, request.sends)) + sum(map(_NBYTES, request.recvs)) <= SMALL_BYTES


_NBYTES = operator.attrgetter("nbytes")
#: what a reduction's template is kept by, per tensor
_SIGNATURE = operator.attrgetter("dtype", "shape")


_M = TypeVar("_M", bound=Callable[..., Any])


def _opaque(method: _M) -> _M:
    """A call of torch's front end, run as it is under torch.compile: dynamo
    stops at it (a graph break), as at gloo's C++ group, instead of tracing
    into the worker, the engine and MPI (DDP broadcasts its buffers inside a
    compiled forward). torch.compiler.disable is applied only where dynamo
    traces the call (torch.compiler.is_compiling), made at the first such
    call: it imports dynamo (0.9-2.3 s here, at a program's first collective),
    which a program that never compiles does not need, and its wrapper costs a
    small call 1.1 us; run eagerly, the method runs as it is."""
    disabled: List[Callable[..., Any]] = []

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if not disabled:
                disabled.append(torch.compiler.disable(method))
            return disabled[0](*args, **kwargs)
        return method(*args, **kwargs)
    return cast(_M, call)


class _Signature:
    """A kept reduction signature: its Collective (``template``), and the last small
    call's tensors with their host views and addresses."""

    __slots__ = ("template", "last")

    def __init__(self, template: Collective) -> None:
        self.template = template
        self.last: Optional[Tuple[Tuple[Any, ...], Tuple[np.ndarray, ...],
                                  Tuple[int, ...]]] = None

    def again(self, tensors: Sequence[Any]) -> Optional[Tuple[np.ndarray, ...]]:
        """The last small call's host views where it passed the very same
        ``tensors``, each still a contiguous CPU tensor at the same address (a
        tensor's ``.numpy()`` costs a small call 7 us of its 50); else None."""
        last = self.last
        if last is None or len(tensors) != len(last[0]):
            return None
        for t, kept, address in zip(tensors, last[0], last[2]):
            if t is not kept or t.data_ptr() != address or not t.is_cpu or \
                    not t.is_contiguous():
                return None
        return last[1]

    def views(self, tensors: Sequence[Any], name: str) -> Tuple[np.ndarray, ...]:
        """The host views of ``tensors``: the last call's (``again``), else made
        anew, and kept where small (a view holds its tensor)."""
        known = self.again(tensors)
        if known is not None:
            return known
        arrays = tuple([_host(t, name, i) for i, t in enumerate(tensors)])
        if sum(a.nbytes for a in arrays) <= SMALL_BYTES:
            self.last = (tuple(tensors), arrays, tuple(t.data_ptr() for t in tensors))
        return arrays


#: torch's stubs type ProcessGroup's methods by the front end's overloads; a
#: backend's are called by torch with (tensors, options), as overridden here
_Base: Any = dist.ProcessGroup


class MpiProcessGroup(_Base):
    """A torch ``ProcessGroup`` over a Group of the engine (see the module).

    Args:
        group: the group's ranks, with point-to-point messages.
        name: the group's name, as torch knows it.
    """

    def __init__(self, group: Group, name: str) -> None:
        super().__init__(group.rank, group.size)
        self.group = group
        self.label = name
        self.worker = Worker(name)
        self.backend_checked = False
        self.ops_checked: Set[Tuple[str, FrozenSet[Any]]] = set()   # (op, dtypes) passed
        # the reductions' signatures (_reduction): each one's Collective and the host
        # views of its last small call's tensors
        self.templates: Dict[Tuple[Any, ...], _Signature] = {}

    def run(self, call: Callable[[], Any]) -> Any:
        """``call()`` on the group's worker, after the calls queued before it; its
        result (or its error, raised here)."""
        return self.worker.submit(call, "a change of the group").result()

    def new_group(self, ranks: Sequence[int], timeout: Optional[timedelta] = None,
                  pg_options: Any = None, group_name: Optional[str] = None,
                  group_desc: Optional[str] = None) -> Optional["MpiProcessGroup"]:
        """The process group of ``ranks`` (torch's ``new_group`` asks the default
        group, whatever backend it was given: one asked for another backend
        refuses its first call, ``backend_problem``): collective over this
        group, every rank naming the same ranks (agreed; torch sorts them),
        made on its worker after its queued calls; None on the ranks not in it."""
        made = self.run(functools.partial(self.group.split_ranks, ranks, watch_seconds(timeout)))
        return None if made is None else MpiProcessGroup(made, group_name or "")

    def subgroup(self, ranks: Sequence[int], timeout: Optional[float],
                 name: str) -> "MpiProcessGroup":
        """The process group of ``ranks`` (collective over them only: torch asks
        a backend for a group of which this rank is a member), made on this
        group's worker after its queued calls."""
        return MpiProcessGroup(self.run(functools.partial(self.group.subgroup, ranks, timeout)),
                               name)

    # -- torch's questions -------------------------------------------------
    def getBackendName(self) -> str:
        return "mpigrad"

    @property
    def group_name(self) -> str:
        return self.label

    def name(self) -> str:
        return "mpigrad"

    def backend_problem(self) -> Optional[Exception]:
        """Why this group cannot serve as torch says it does (once): torch
        2.13's ``new_group(backend="gloo")`` under an "mpigrad" default group
        hands the group to the default group, which can only make its own."""
        if self.backend_checked:
            return None
        try:
            backend = str(dist.get_backend(self))
        except (RuntimeError, ValueError):     # not registered with torch yet (its init)
            return None
        if backend == "mpigrad":
            self.backend_checked = True
            return None
        return ValueError(
            f"new_group(backend={backend!r}) under the default group 'mpigrad': torch "
            f"{torch.__version__} hands every new group to the default group's backend, so "
            f"this group would be mpigrad's, not {backend}'s, without a word; create it with "
            f"backend='mpigrad' (or none), or make {backend!r} the default group "
            f"(init_process_group({backend!r})) and new_group(backend='mpigrad') of every "
            "rank beside it")

    # -- the one path: translate, run, hand back ----------------------------
    def _submit(self, translate: Callable[[], Union[Collective, Kept]],
                result: Any) -> dist.Work:
        """The Collective ``translate`` makes (or its error, agreed: this
        group's backend problem first) run on the group, on its worker: a
        Work whose future holds ``result``."""
        problem = self.backend_problem()
        request = _requested(translate) if problem is None else problem
        what = "a refused call" if isinstance(request, Exception) else request.name
        return self.worker.submit(functools.partial(self._run, request, result), what,
                                  small=_small(request))

    def _run(self, request: Union[Request, Kept], result: Any) -> Any:
        self.group.run(request)
        return result

    # -- reductions --------------------------------------------------------
    @_opaque
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        op_name = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        repeated = self._repeated("all_reduce", tensors, op_name)
        if repeated is not None:
            return self.worker.submit(functools.partial(self._run, repeated, tensors),
                                      "all_reduce", small=True)
        if _any_sparse(tensors):
            request = _requested(lambda: self._sparse_rows(tensors, op_name))
            return self.worker.submit(functools.partial(self._sum_sparse, request, tensors[0]),
                                      "all_reduce (sparse)")
        return self._submit(lambda: self._reduction("all_reduce", tensors, op_name), tensors)

    def _sparse_rows(self, tensors: Sequence[Any], op_name: str) -> Collective:
        """A sparse all_reduce as gloo makes it: every rank's (coalesced)
        entries gathered (the row gather: indices and values), then summed
        by torch's coalesce on each rank (in rank order: the same bits)."""
        if len(tensors) != 1 or op_name != "SUM":
            raise ValueError(f"all_reduce of a sparse tensor: expecting one tensor and SUM, got "
                             f"{len(tensors)} tensor(s) and {op_name}")
        tensor = tensors[0].coalesce()
        indices = tensor.indices().t().contiguous().numpy()          # [nnz, sparse dims]
        values = numpy_from_torch(tensor.values().contiguous())
        item = (f"sparse {_item(tensors[0])}, {tensor.sparse_dim()} sparse "
                f"dimension(s)")
        return Collective(Kind.ALLGATHER, "all_reduce (sparse)", (indices, values),
                          items=(item,))

    def _sum_sparse(self, request: Request, tensor: Any) -> List[Any]:
        """Run the row gather of ``request``; ``tensor`` becomes the sum of every rank's."""
        (indices, values), _ = self.group.run(request)
        total = torch.sparse_coo_tensor(torch.from_numpy(indices).t(), torch_from_numpy(values),
                                        tensor.shape).coalesce()
        tensor.copy_(total)
        return [tensor]

    @_opaque
    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        op_name = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._submit(
            lambda: self._reduction("all_reduce_coalesced", list(tensors), op_name), tensors)

    @_opaque
    def reduce(self, tensors: Any, opts: Any) -> dist.Work:
        return self._submit(lambda: self._reduction(
            "reduce", list(tensors), _op_name(opts.reduceOp), opts.rootRank), tensors)

    def _repeated(self, name: str, tensors: Sequence[Any], op_name: str) -> Optional[Kept]:
        """A small all_reduce of the very tensors of its signature's last call
        (checked then: CPU, contiguous, its op and dtypes; a sparse tensor is never
        kept), as its Kept: nothing to translate (a metric's every step pays
        for every microsecond); None for any other call."""
        _, known = self._known(name, op_name, None, tensors)
        if known is None or self.backend_problem() is not None:
            return None
        views = known.again(tensors)
        return None if views is None else Kept(known.template, views)

    def _known(self, name: str, op_name: str, root: Optional[int],
               tensors: Sequence[Any]) -> Tuple[Any, Optional[_Signature]]:
        """(the reduction's signature key, its kept _Signature or None); (None, None)
        where ``tensors`` are not all tensors (refused by the caller's checks)."""
        try:
            key = (name, op_name, root, *map(_SIGNATURE, tensors))
            return key, self.templates.get(key)
        except (AttributeError, TypeError):
            return None, None

    def _reduction(self, name: str, tensors: Sequence[Any], op_name: str,
                   root: Optional[int] = None) -> Kept:
        """all_reduce (``root`` None) or reduce of ``tensors`` in place: the
        Collective of its signature, made once and kept (a small call pays for
        every microsecond), with this call's arrays."""
        if root is not None:
            self._root(root, name)
        key, known = self._known(name, op_name, root, tensors)
        if known is not None:                    # its op and dtypes checked at the first
            return Kept(known.template, known.views(tensors, name))
        arrays = self._check_op(tensors, op_name, name)
        if len(self.templates) >= _KEPT_TEMPLATES:
            self.templates.clear()
        template = Collective(Kind.ALLREDUCE if root is None else Kind.REDUCE, name,
                              op=_OPS[op_name], root=root, items=_items(tensors))
        self.templates[key] = _Signature(template)
        return Kept(template, tuple(arrays))

    @_opaque
    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any) -> dist.Work:
        """Each rank's output: the reduction of every rank's inputs[rank]."""
        return self._submit(lambda: self._reduce_scatter(
            outputs[0], inputs[0], _op_name(opts.reduceOp)), outputs)

    def _reduce_scatter(self, output: Any, chunks: Sequence[Any], op_name: str) -> Collective:
        if len(chunks) != self.group.size:
            raise ValueError(f"reduce_scatter: expecting {self.group.size} input tensors "
                             f"(one per rank), got {len(chunks)}")
        for i, chunk in enumerate(chunks):
            if chunk.shape != output.shape or chunk.dtype != output.dtype:
                raise ValueError(f"reduce_scatter: input {i} is {_item(chunk)}, expecting "
                                 f"the output's {_item(output)}")
        arrays = self._check_op([output, *chunks], op_name, "reduce_scatter")
        return Collective(Kind.REDUCE_SCATTER, "reduce_scatter", tuple(arrays[1:]),
                          (arrays[0],), op=_OPS[op_name], items=(_item(output),))

    @_opaque
    def reduce_scatter_single(self, output: Any, input: Any, opts: Any) -> dist.Work:
        """``output`` gets this rank's 1/p of the reduction of ``input``."""
        return self._submit(lambda: self._reduce_scatter_single(
            output, input, _op_name(opts.reduceOp)), output)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter_single(self, output: Any, input: Any, op_name: str) -> Collective:
        arrays = self._check_op([output, input], op_name, "reduce_scatter_tensor")
        if input.numel() != output.numel() * self.group.size or input.dtype != output.dtype:
            raise ValueError(f"reduce_scatter_tensor: expecting an input of "
                             f"{self.group.size} x the output's {output.numel()} elements "
                             f"of {output.dtype}, got {_item(input)}")
        return Collective(Kind.REDUCE_SCATTER, "reduce_scatter_tensor", (arrays[1],),
                          (arrays[0],), op=_OPS[op_name], items=_items([output, input]))

    def _check_op(self, tensors: Sequence[Any], op_name: str, what: str) -> List[np.ndarray]:
        """The tensors' host views; an error where the op cannot take them
        (the op table's rules, torch's way: mpigrad._collective.ops.TORCH)."""
        if op_name not in _OPS:
            raise NotImplementedError(
                f"{what}: op {op_name} is not supported by the mpigrad backend: expecting "
                f"{', '.join(_OPS)} (for PREMUL_SUM, scale the tensor and use SUM)")
        arrays = [_host(tensor, what, i) for i, tensor in enumerate(tensors)]
        key = (op_name, frozenset([t.dtype for t in tensors]))
        if key not in self.ops_checked:            # (one check per op and set of dtypes)
            dtypes = [np.dtype(np.complex64 if t.is_complex() else a.dtype)
                      for t, a in zip(tensors, arrays)]
            check_op(_OPS[op_name], dtypes, what, TORCH)
            self.ops_checked.add(key)
        return arrays

    # -- data movement -----------------------------------------------------
    def _root(self, root: int, what: str) -> None:
        if not isinstance(root, int) or not 0 <= root < self.group.size:
            raise ValueError(f"{what}: expecting a root rank in [0, {self.group.size}) of the "
                             f"group, got {root!r}")

    @_opaque
    def broadcast(self, tensors: Any, opts: Any) -> dist.Work:
        return self._submit(lambda: self._broadcast(list(tensors), opts.rootRank), tensors)

    def _broadcast(self, tensors: Sequence[Any], root: int) -> Collective:
        self._root(root, "broadcast")
        return Collective(Kind.BROADCAST, "broadcast",
                          tuple(_host(t, "broadcast") for t in tensors), root=root,
                          items=_items(tensors))

    @_opaque
    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        """outputs[0][r] gets rank r's inputs[0]."""
        return self._submit(lambda: self._allgather(outputs[0], inputs[0]), outputs)

    def _allgather(self, output_list: Sequence[Any], tensor: Any) -> Collective:
        self._each_like(output_list, tensor, "all_gather")
        return Collective(Kind.ALLGATHER, "all_gather", (_host(tensor, "all_gather"),),
                          tuple(_host(out, "all_gather") for out in output_list),
                          items=(_item(tensor),))

    @_opaque
    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> dist.Work:
        """``output`` (p x the input's elements) gets every rank's input in
        rank order (the input may alias this rank's part of it)."""
        return self._submit(lambda: self._all_gather_single(output, input), output)

    _allgather_base = all_gather_single

    def _all_gather_single(self, output: Any, input: Any) -> Collective:
        if output.numel() != input.numel() * self.group.size or output.dtype != input.dtype:
            raise ValueError(f"all_gather_into_tensor: expecting an output of "
                             f"{self.group.size} x the input's {input.numel()} elements of "
                             f"{input.dtype}, got {_item(output)}")
        return Collective(Kind.ALLGATHER, "all_gather_into_tensor",
                          (_host(input, "all_gather_into_tensor"),),
                          (_host(output, "all_gather_into_tensor"),), items=(_item(input),))

    @_opaque
    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        """outputs[r][i] gets rank r's inputs[i]: one message of them all."""
        return self._submit(lambda: self._allgather_coalesced(outputs, inputs), outputs)

    def _allgather_coalesced(self, outputs: Sequence[Sequence[Any]],
                             inputs: Sequence[Any]) -> Collective:
        if len(outputs) != self.group.size:
            raise ValueError(f"all_gather_coalesced: expecting {self.group.size} output lists "
                             f"(one per rank), got {len(outputs)}")
        for r, output_list in enumerate(outputs):
            if _items(output_list) != _items(inputs):
                raise ValueError(f"all_gather_coalesced: output list {r} is "
                                 f"{list(_items(output_list))}, expecting the inputs' "
                                 f"{list(_items(inputs))}")
        what = "all_gather_coalesced"
        packed = np.concatenate([_host(t, what).view(np.uint8) for t in inputs]
                                or [np.zeros(0, np.uint8)])
        return Collective(Kind.ALLGATHER, what, (packed,),
                          tuple(_host(t, what) for output_list in outputs for t in output_list),
                          items=_items(inputs))

    @_opaque
    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any,
                                        opts: Any = None) -> dist.Work:
        for output, tensor in zip(outputs, inputs):
            self.all_gather_single(output, tensor, opts).wait()
        return Done(outputs)

    @_opaque
    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any,
                                        opts: Any) -> dist.Work:
        for output, tensor in zip(outputs, inputs):
            self.reduce_scatter_single(output, tensor, opts).wait()
        return Done(outputs)

    @_opaque
    def gather(self, outputs: Any, inputs: Any, opts: Any) -> dist.Work:
        return self._submit(lambda: self._gather(outputs, inputs[0], opts.rootRank), outputs)

    def _gather(self, outputs: Any, tensor: Any, root: int) -> Collective:
        self._root(root, "gather")
        mine = self.group.rank == root
        if mine:
            self._each_like(outputs[0], tensor, "gather")
        return Collective(Kind.GATHER, "gather", (_host(tensor, "gather"),),
                          tuple(_host(out, "gather") for out in outputs[0]) if mine else (),
                          root=root, items=(_item(tensor),))

    @_opaque
    def scatter(self, outputs: Any, inputs: Any, opts: Any) -> dist.Work:
        return self._submit(lambda: self._scatter(outputs[0], inputs, opts.rootRank), outputs)

    def _scatter(self, tensor: Any, inputs: Any, root: int) -> Collective:
        self._root(root, "scatter")
        mine = self.group.rank == root
        if mine:
            self._each_like(inputs[0], tensor, "scatter")
        return Collective(Kind.SCATTER, "scatter",
                          tuple(_host(t, "scatter") for t in inputs[0]) if mine else (),
                          (_host(tensor, "scatter"),), root=root, items=(_item(tensor),))

    @_opaque
    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        """outputs[r] gets rank r's inputs[this rank] (any sizes)."""
        return self._submit(lambda: self._alltoall(outputs, inputs), outputs)

    def _alltoall(self, outputs: Sequence[Any], inputs: Sequence[Any]) -> Collective:
        for what, tensors in (("output", outputs), ("input", inputs)):
            if len(tensors) != self.group.size:
                raise ValueError(f"all_to_all: expecting {self.group.size} {what} tensors "
                                 f"(one per rank), got {len(tensors)}")
        dtypes = {t.dtype for t in [*outputs, *inputs]}
        if len(dtypes) != 1:
            raise TypeError(f"all_to_all: expecting one dtype, got {sorted(map(str, dtypes))}")
        return Collective(Kind.ALLTOALL, "all_to_all",
                          tuple(_host(t, "all_to_all") for t in inputs),
                          tuple(_host(t, "all_to_all") for t in outputs),
                          items=(str(next(iter(dtypes))),))

    @_opaque
    def all_to_all_single(self, output: Any, input: Any, output_splits: Sequence[int],
                          input_splits: Sequence[int], opts: Any = None) -> dist.Work:
        """Rows of ``input`` split by ``input_splits`` (equal parts when
        empty) go to the ranks in order; ``output`` gets theirs likewise."""
        return self._submit(lambda: self._all_to_all_single(
            output, input, output_splits, input_splits), output)

    def _all_to_all_single(self, output: Any, input: Any, output_splits: Sequence[int],
                           input_splits: Sequence[int]) -> Collective:
        if output.dtype != input.dtype:
            raise TypeError(f"all_to_all_single: expecting one dtype, got {input.dtype} "
                            f"and {output.dtype}")
        return Collective(Kind.ALLTOALL, "all_to_all_single",
                          self._rows(input, input_splits, "input"),
                          self._rows(output, output_splits, "output"),
                          items=(str(input.dtype),))

    def _rows(self, tensor: Any, splits: Sequence[int], what: str) -> Tuple[np.ndarray, ...]:
        """The host views of ``tensor``'s rows cut by ``splits`` (equal parts when empty)."""
        rows = tensor.shape[0] if tensor.dim() else 1
        splits = list(splits) or [rows // self.group.size] * self.group.size
        if len(splits) != self.group.size or sum(splits) != rows:
            raise ValueError(f"all_to_all_single: expecting {self.group.size} {what} splits "
                             f"summing to {rows} rows, got {list(splits)}")
        flat, row = _host(tensor, "all_to_all_single"), tensor[0].numel() if rows else 0
        bounds = np.cumsum([0, *splits]) * row
        return tuple(flat[a:b] for a, b in zip(bounds[:-1], bounds[1:]))

    def _each_like(self, tensors: Sequence[Any], like: Any, what: str) -> None:
        if len(tensors) != self.group.size:
            raise ValueError(f"{what}: expecting {self.group.size} tensors (one per rank), got "
                             f"{len(tensors)}")
        for i, t in enumerate(tensors):
            if t.shape != like.shape or t.dtype != like.dtype:
                raise ValueError(f"{what}: tensor {i} is {_item(t)}, expecting {_item(like)}")

    # -- synchronisation and point-to-point --------------------------------
    @_opaque
    def barrier(self, opts: Any = None) -> dist.Work:
        return self._submit(lambda: Collective(Kind.BARRIER, "barrier"), None)

    @_opaque
    def monitored_barrier(self, timeout: Optional[timedelta] = None,
                          wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier: every rank reports to rank 0 within
        ``timeout`` (default the group's), else a RuntimeError naming the first
        rank that did not (``wait_all_ranks``: every one); the group stays
        usable."""
        seconds = timeout.total_seconds() if timeout is not None else \
            self.group.communicator.timeout
        missing = self.run(functools.partial(self.group.arrivals, seconds, _MONITOR_TAG))
        if missing:
            rank = self.group.rank
            named = missing if wait_all_ranks or rank != 0 else missing[:1]
            raise RuntimeError(
                f"Rank {rank} timed out in monitoredBarrier after {(seconds or 0) * 1000:g} ms: "
                + (f"ranks {named} failed to pass monitoredBarrier" if rank == 0 else
                   "rank 0 did not answer (it timed out, or it never came)"))

    @_opaque
    def send(self, tensors: Any, dst: int, tag: int = 0) -> dist.Work:
        return self._post("Send", tensors, dst, tag, f"send to rank {dst} (tag {tag})")

    @_opaque
    def recv(self, tensors: Any, src: int, tag: int = 0) -> dist.Work:
        return self._post("Recv", tensors, src, tag, f"recv from rank {src} (tag {tag})")

    @_opaque
    def recv_anysource(self, tensors: Any, tag: int = 0) -> dist.Work:
        """Receive from whichever rank sends first (``recv(src=None)``); the
        Work's ``_source_rank()`` names it once done."""
        return self._post("Recv", tensors, None, tag, f"recv from any rank (tag {tag})")

    def _post(self, name: str, tensors: Any, peer: Optional[int], tag: int,
              what: str) -> dist.Work:
        """A message posted on the worker in call order, completed beside the
        later calls; its Work's ``wait`` is bounded by the group's timeout."""
        arrays = [_host(tensor, what) for tensor in tensors]
        start = functools.partial(self.group.post, name, arrays, peer, tag, what)
        return self.worker.post(start, tensors, what, self.group.communicator.timeout)

    def shutdown(self) -> None:
        """Free the group (destroy_process_group), once the calls queued before
        are done."""
        self.worker.stop()
        self.group.free()


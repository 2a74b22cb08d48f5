"""DistributedOptimizer: every step uses gradients averaged over the ranks,
reduced as backward finishes them (Horovod's interface: ``synchronize()``,
``skip_synchronize()``, ``backward_passes_per_step``, sparse gradients kept
sparse; plus DDP's ``no_sync()``)."""

import contextlib
import functools
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch

from .._base.arrays import numpy_from_torch, torch_from_numpy
from .._base.row_sparse import RowSparse
from ..reducer import PendingReduction
from .wrapper import Wrapped, Wrapper, keep_grad_in, trainable, wrap

__all__ = ["DistributedOptimizer"]


def _numpy_like(param: torch.Tensor) -> Any:
    """A zeroed host array shaped and typed like ``param`` (bfloat16 included)."""
    return numpy_from_torch(torch.zeros(tuple(param.shape), dtype=param.dtype))


class _Reduction(Wrapper):
    """A DistributedOptimizer's step: its gradients live in the reducer's
    bucket memory, each reduced as soon as backward has finished it."""

    def __init__(self, optimizer: torch.optim.Optimizer, backward_passes_per_step: int,
                 reducer_options: Dict[str, Any],
                 named_parameters: Optional[List[Tuple[str, torch.Tensor]]],
                 sparse_as_dense: bool) -> None:
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step: expecting an int >= 1, "
                             f"got {backward_passes_per_step!r}")
        super().__init__(optimizer, reducer_options, named_parameters)
        self.sparse_as_dense = sparse_as_dense
        self.sparse: Set[int] = set()         # id(param): its gradients come sparse
        self.densified: Dict[int, int] = {}   # sparse_as_dense: id(param) -> sparse_dim
        self.passes = backward_passes_per_step
        self.counts: Dict[int, int] = {}      # id(param) -> backward passes this step
        self.pending: Optional[PendingReduction] = None   # this step's reduction
        self.synchronized = False
        self.quiet = False                    # inside no_sync()
        self.hook([p for group in optimizer.param_groups for p in group["params"]
                   if p.requires_grad])
        self.adopt(keep=False)
        self.reset()

    def adopt(self, keep: bool = True) -> None:
        """Take the parameters of every group (again, after add_param_group):
        their gradients in bucket memory, zeros unless ``keep`` (collective
        with node memory)."""
        self.params, _, self.left_out = trainable(self.optimizer.param_groups)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.on_host = all(p.device.type == "cpu" for p in self.params)
        if self.on_host:
            # gradients live in bucket memory (DDP's gradient_as_bucket_view):
            # a step packs and unpacks nothing for fp32 parameters; the
            # reducer is handed the numpy views themselves (half precision:
            # the arrays behind the gradients)
            self.arrays: List[Any] = self.reducer.bucket_views(
                [_numpy_like(p) for p in self.params])
            grads = [torch_from_numpy(v) for v in self.arrays]
        else:
            grads = [torch.zeros_like(p) for p in self.params]
            self.arrays = grads
        for p, g in zip(self.params, grads):
            # bucket memory starts uninitialised: gradients exist (zeros, or
            # the ones they had before groups were added) as soon as wrapped
            if p.grad is None or not keep:
                g.zero_()
            else:
                g.copy_(p.grad)
            p.grad = g
        self.grads = grads
        self.stale = False

    def hook(self, params: List[torch.Tensor]) -> None:
        """Wrapper's hooks, and ``incoming`` with each gradient backward is
        about to accumulate into a parameter."""
        fresh = [p for p in params if id(p) not in self.hooks]
        super().hook(params)
        for p in fresh:
            self.hooks[id(p)].append(p.register_hook(functools.partial(self.incoming, p)))

    def incoming(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """A sparse gradient (``nn.Embedding(sparse=True)``) stays sparse:
        accumulated by autograd on its own instead of into bucket memory,
        and reduced as row-sparse (Allgatherv) in ``synchronize``; with
        ``sparse_as_dense``, accumulated into bucket memory, reduced dense
        and handed to the optimizer sparse again (as Horovod does)."""
        if grad.layout != torch.sparse_coo:
            return
        if self.sparse_as_dense:
            self.densified[id(param)] = grad.sparse_dim()
        else:
            self.sparse.add(id(param))
            index = self.index.get(id(param))
            if index is not None and param.grad is self.grads[index]:
                param.grad = None

    def add_param_group(self, add: Callable[[Dict[str, Any]], None],
                        group: Dict[str, Any]) -> None:
        if self.pending is not None and not self.synchronized:
            raise RuntimeError("add_param_group: a gradient reduction is in progress; add "
                               "parameter groups between steps (after step() or zero_grad())")
        add(group)
        self.hook([p for p in group["params"] if p.requires_grad])
        self.stale = True

    def reset(self) -> None:
        self.pending = None
        self.counts.clear()
        self.synchronized = False
        self.skip = False
        self.quiet = False

    def keep(self, param: torch.Tensor, buffer: torch.Tensor) -> None:
        """``keep_grad_in``; a sparse gradient stays as it is (its bucket
        memory holds zeros)."""
        if id(param) in self.sparse:
            buffer.zero_()
        else:
            keep_grad_in(param, buffer)

    def keep_all(self) -> None:
        for p, g in zip(self.params, self.grads):
            self.keep(p, g)

    def gradient_ready(self, param: torch.Tensor) -> None:
        if self.synchronized:          # a step was skipped (GradScaler): start anew
            self.reset()
        if self.stale and self.pending is None:
            self.adopt()               # parameter groups were added
        index = self.index.get(id(param))
        if index is None:              # added, or frozen when wrapped
            return
        if self.pending is None and not self.quiet:
            # the first gradient of this step: gradients reset to None since the
            # last step count as zero (unused parameters), in bucket memory
            self.keep_all()
        else:
            self.keep(param, self.grads[index])
        if self.quiet:
            return
        count = self.counts[id(param)] = self.counts.get(id(param), 0) + 1
        if count == self.passes and self.on_host:
            self.begin().ready(index)

    def begin(self) -> PendingReduction:
        """This step's reduction, started now if it was not."""
        if self.pending is None:
            self.pending = self.reducer.start(self.arrays, agree=self.agreed_steps)
        return self.pending

    def synchronize(self) -> None:
        if self.synchronized:
            return
        if self.stale and self.pending is None:
            self.adopt()
        self.keep_all()
        # the backward passes this step holds: the same on every rank, or an
        # error on every rank before any optimizer steps (a rank that ran one
        # more would have written into buckets already being summed)
        passes = max(self.counts.values(), default=0)
        sparse = [i for i, p in enumerate(self.params)
                  if id(p) in self.sparse and p.grad is not None and p.grad.is_sparse]
        try:
            with torch.no_grad():
                self.begin().wait(agree={
                    f"backward passes in the step (backward_passes_per_step="
                    f"{self.passes})": passes,
                    "parameters with sparse gradients": tuple(sparse)})
                if sparse:
                    self.reduce_sparse(sparse)
                for key, sparse_dim in self.densified.items():
                    index = self.index.get(key)
                    if index is not None:
                        self.params[index].grad = self.grads[index].to_sparse(sparse_dim)
        except BaseException:
            self.reset()               # the next step starts anew
            raise
        self.synchronized = True
        # after the reduction, so that every rank has done the same collectives
        for p, where in self.left_out:
            if p.grad is not None:
                raise RuntimeError(
                    f"{where} has a gradient but had requires_grad=False when the optimizer "
                    "was wrapped, so it is not reduced across ranks; wrap the optimizer "
                    "after unfreezing parameters")

    def reduce_sparse(self, indices: List[int]) -> None:
        """Reduce the sparse gradients of the parameters at ``indices`` as
        row-sparse (every rank's rows gathered; averaged where the reducer
        averages), each staying a sparse tensor."""
        rows = []
        for i in indices:
            sparse = self.params[i].grad
            assert sparse is not None
            grad = sparse.coalesce()
            if grad.sparse_dim() != 1:
                raise ValueError(f"parameter {i}: expecting a sparse gradient of rows "
                                 f"(sparse_dim 1, as nn.Embedding's), got sparse_dim "
                                 f"{grad.sparse_dim()}; pass sparse_as_dense=True")
            rows.append(RowSparse(grad.indices()[0].numpy(), numpy_from_torch(grad.values()),
                                  tuple(grad.shape)))
        for i, reduced in zip(indices, self.reducer.reduce(rows)):
            self.params[i].grad = torch.sparse_coo_tensor(
                torch.from_numpy(reduced.indices).reshape(1, -1),
                torch_from_numpy(reduced.values), reduced.dense_shape,
                check_invariants=False)           # valid: RowSparse checked its rows

    def step(self, closure: Optional[Callable[[], Any]],
             step: Callable[[Optional[Callable[[], Any]]], Any]) -> Any:
        if self.synchronized and not self.skip:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                          "after optimizer.synchronize(): the gradients are not reduced "
                          "again, but wrap the step in skip_synchronize() to say so",
                          stacklevel=3)
        if not self.skip:
            self.synchronize()
        try:
            result = step(closure)
            self.steps += 1
            return result
        finally:
            self.reset()

    def zero_grad(self, set_to_none: bool) -> None:
        """Zero the gradients in bucket memory (either way: the storage is
        kept); those of parameters not reduced (yet) as torch's zero_grad."""
        if self.pending is not None and not self.synchronized:
            self.synchronize()             # finish what was started: every rank alike
        for p, g in zip(self.params, self.grads):
            g.zero_()
            p.grad = g
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self.index and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
        self.reset()


class _Distributed(Wrapped):
    """What a DistributedOptimizer adds to its optimizer's class."""

    mpigrad: _Reduction

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block only accumulate locally."""
        self.mpigrad.quiet = True
        try:
            yield
        finally:
            self.mpigrad.quiet = False

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group (torch's); its gradients are reduced from the
        next step on (every rank must add it alike: a difference raises on
        every rank when that step's reduction starts)."""
        self.mpigrad.add_param_group(super().add_param_group, param_group)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, *, backward_passes_per_step: int = 1,
                         named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                         sparse_as_dense: bool = False,
                         **reducer_options: Any) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that every step uses gradients averaged over the ranks.

    Collective: every rank wraps its optimizer. Each parameter's gradient is
    reduced as soon as backward has finished it (overlap with backward, in
    the same order on every rank); ``step()`` waits, then steps. The
    gradients live in the reducer's bucket memory and are restored there
    whatever ``zero_grad`` the user calls; a parameter that gets no gradient
    in a step counts as zero on every rank. ``backward_passes_per_step=k``
    accumulates k backward passes locally before reducing (scale the loss by
    1/k); ``no_sync()`` does the same for the passes inside it.
    ``reducer_options`` go to ``mpigrad.Reducer`` (``check_finite`` defaults
    to True here, for ``finite``). Parameters with ``requires_grad=False``
    when it is wrapped (frozen layers, integer counters) are left out, as
    Horovod leaves them; one that has a gradient at a later step raises.

    ``named_parameters`` (``model.named_parameters()``) names the parameters
    in ``_parameter_names``, as Horovod's optimizer does. Sparse gradients
    (``nn.Embedding(sparse=True)``, for ``SparseAdam``) stay sparse: every
    rank's rows are gathered (Allgatherv) and averaged; with
    ``sparse_as_dense=True`` they are reduced as dense gradients instead and
    handed to the optimizer sparse again (as Horovod's).

    Returns an optimizer of a subclass of ``optimizer``'s class sharing its
    state and parameter groups, so GradScaler and LR schedulers accept it.
    """
    named = None if named_parameters is None else list(named_parameters)
    return wrap(optimizer, _Distributed,
                lambda wrapped: _Reduction(wrapped, backward_passes_per_step, reducer_options,
                                           named, sparse_as_dense))

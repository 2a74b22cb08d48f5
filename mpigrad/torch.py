"""torch integration: DistributedOptimizer and parameter / optimizer-state broadcast.

Imported only by users who ``import mpigrad.torch``; torch stays optional.

    opt = mpigrad.torch.DistributedOptimizer(torch.optim.Adam(model.parameters()))
    mpigrad.torch.broadcast_parameters(model.state_dict(), root=0)
    mpigrad.torch.broadcast_optimizer_state(opt, root=0)

The interface is Horovod's: ``synchronize()``, ``skip_synchronize()``,
``backward_passes_per_step``; plus DDP's ``no_sync()``.
"""

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from ._base.arrays import numpy_from_torch, torch_from_numpy
from .collectives import broadcast, broadcast_object
from .reducer import Reducer
from .torch_wrapped import Wrapped, keep_grad_in
from .torch_shard import ShardedOptimizer

__all__ = ["DistributedOptimizer", "ShardedOptimizer", "broadcast_parameters",
           "broadcast_optimizer_state"]


def _numpy_like(param: torch.Tensor) -> Any:
    """A zeroed host array shaped and typed like ``param`` (bfloat16 included)."""
    return numpy_from_torch(torch.zeros(tuple(param.shape), dtype=param.dtype))


class _Distributed(Wrapped):
    """The methods a wrapped optimizer gains (mixed into a subclass of its class:
    the MRO is this, the optimizer's class, then torch.optim.Optimizer)."""

    _mp_pending: Any       # the PendingReduction of this step, or None

    def mpigrad_setup(self, backward_passes_per_step: int,
                      reducer_options: Dict[str, Any]) -> None:
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step: expecting an int >= 1, "
                             f"got {backward_passes_per_step!r}")
        self._mp_passes = backward_passes_per_step
        self._mp_steps = 0                 # steps taken: agreed when a reduction starts
        options = {"check_finite": True, **reducer_options}
        self._mp_reducer = Reducer(**options)
        self._mp_handles: Dict[int, Any] = {}     # id(param) -> its hook's handle
        self._mp_counts: Dict[int, int] = {}      # id(param) -> backward passes this step
        self._mp_hook_params()
        self._mp_adopt(keep=False)
        self._mp_reset()

    def _mp_hook_params(self) -> None:
        """Hook every parameter that takes gradients and has no hook yet."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in self._mp_handles:
                    self._mp_handles[id(p)] = p.register_post_accumulate_grad_hook(self._mp_hook)

    def _mp_adopt(self, keep: bool = True) -> None:
        """Take the parameters of every group (again, after add_param_group):
        their gradients in bucket memory, zeros unless ``keep`` (collective
        with node memory)."""
        seen, params, left_out = set(), [], []
        for g, group in enumerate(self.param_groups):
            for k, p in enumerate(group["params"]):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                # as Horovod: parameters without gradients (frozen, or
                # integer counters) are left out of the reduction
                if p.requires_grad:
                    params.append(p)
                else:
                    left_out.append((p, f"param_groups[{g}]['params'][{k}]"))
        self._mp_params = params
        self._mp_left_out = left_out
        self._mp_index = {id(p): i for i, p in enumerate(params)}
        self._mp_on_host = all(p.device.type == "cpu" for p in params)
        if self._mp_on_host:
            # gradients live in bucket memory (DDP's gradient_as_bucket_view):
            # a step packs and unpacks nothing for fp32 parameters; the
            # reducer is handed the numpy views themselves (half precision:
            # the arrays behind the gradients)
            like = [_numpy_like(p) for p in params]
            self._mp_arrays = self._mp_reducer.bucket_views(like)
            grads = [torch_from_numpy(v) for v in self._mp_arrays]
        else:
            grads = [torch.zeros_like(p) for p in params]
            self._mp_arrays = grads
        for p, g in zip(params, grads):
            # bucket memory starts uninitialised: gradients exist (zeros, or
            # the ones they had before groups were added) as soon as wrapped
            if p.grad is None or not keep:
                g.zero_()
            else:
                g.copy_(p.grad)
            p.grad = g
        self._mp_grads = grads
        self._mp_stale = False

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group (torch's); its gradients are reduced from the
        next step on (every rank must add it alike: a difference raises on
        every rank when that step's reduction starts)."""
        if getattr(self, "_mp_pending", None) is not None and not self._mp_synchronized:
            raise RuntimeError("add_param_group: a gradient reduction is in progress; add "
                               "parameter groups between steps (after step() or zero_grad())")
        super().add_param_group(param_group)
        self._mp_hook_params()
        self._mp_stale = True

    def _mp_reset(self) -> None:
        self._mp_pending = None            # the PendingReduction of this step
        self._mp_counts.clear()
        self._mp_synchronized = False
        self._mp_skip = False
        self._mp_quiet = False             # inside no_sync()

    def _mp_restore(self, index: int) -> None:
        """Put ``params[index].grad`` back into bucket memory if it was replaced."""
        keep_grad_in(self._mp_params[index], self._mp_grads[index])

    def _mp_restore_all(self) -> None:
        for i in range(len(self._mp_params)):
            self._mp_restore(i)

    def _mp_hook(self, param: torch.Tensor) -> None:
        if self._mp_synchronized:          # a step was skipped (GradScaler): start anew
            self._mp_reset()
        if self._mp_stale and self._mp_pending is None:
            self._mp_adopt()               # parameter groups were added
        index = self._mp_index.get(id(param))
        if index is None:                  # added, or frozen when wrapped
            return
        if self._mp_pending is None and not self._mp_quiet:
            # the first gradient of this step: gradients reset to None since the
            # last step count as zero (unused parameters), in bucket memory
            self._mp_restore_all()
        else:
            self._mp_restore(index)
        if self._mp_quiet:
            return
        count = self._mp_counts[id(param)] = self._mp_counts.get(id(param), 0) + 1
        if count == self._mp_passes and self._mp_on_host:
            self._mp_begin().ready(index)

    def _mp_begin(self) -> Any:
        """This step's PendingReduction, started now if it was not."""
        if self._mp_pending is None:
            # the ranks agree on the step: a rank that reduced twice in a step
            # (an extra zero_grad) or skipped one is found here
            self._mp_pending = self._mp_reducer.start(
                self._mp_arrays, agree={"optimizer steps taken": self._mp_steps})
        return self._mp_pending

    # -- the Horovod / DDP interface ---------------------------------------
    def synchronize(self) -> None:
        """Finish the gradient reduction now (before GradScaler.unscale_ or
        clipping); then step inside ``skip_synchronize()``."""
        if self._mp_synchronized:
            return
        if self._mp_stale and self._mp_pending is None:
            self._mp_adopt()
        self._mp_restore_all()
        # the backward passes this step holds: the same on every rank, or an
        # error on every rank before any optimizer steps (a rank that ran one
        # more would have written into buckets already being summed)
        passes = max(self._mp_counts.values(), default=0)
        try:
            with torch.no_grad():
                self._mp_begin().wait(agree={
                    f"backward passes in the step (backward_passes_per_step="
                    f"{self._mp_passes})": passes})
        except BaseException:
            self._mp_reset()               # the next step starts anew
            raise
        self._mp_synchronized = True
        # after the reduction, so that every rank has done the same collectives
        for p, where in self._mp_left_out:
            if p.grad is not None:
                raise RuntimeError(
                    f"{where} has a gradient but had requires_grad=False when the optimizer "
                    "was wrapped, so it is not reduced across ranks; wrap the optimizer "
                    "after unfreezing parameters")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block only accumulate locally."""
        self._mp_quiet = True
        try:
            yield
        finally:
            self._mp_quiet = False

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Wait for the reduction (unless inside skip_synchronize), then step."""
        if self._mp_synchronized and not self._mp_skip:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                          "after optimizer.synchronize(): the gradients are not reduced "
                          "again, but wrap the step in skip_synchronize() to say so",
                          stacklevel=2)
        if not self._mp_skip:
            self.synchronize()
        try:
            result = super().step(closure)
            self._mp_steps += 1
            return result
        finally:
            self._mp_reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in bucket memory (either way: the storage is
        kept); those of parameters not reduced (yet) as torch's zero_grad."""
        if self._mp_pending is not None and not self._mp_synchronized:
            self.synchronize()             # finish what was started: every rank alike
        for p, g in zip(self._mp_params, self._mp_grads):
            g.zero_()
            p.grad = g
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in self._mp_index and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
        self._mp_reset()

    def free(self) -> None:
        """Remove the hooks and free the reducer."""
        for handle in self._mp_handles.values():
            handle.remove()
        self._mp_reducer.free()


def DistributedOptimizer(optimizer: torch.optim.Optimizer, *, backward_passes_per_step: int = 1,
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

    Returns an optimizer of a subclass of ``optimizer``'s class sharing its
    state and parameter groups, so GradScaler and LR schedulers accept it.
    """
    cls: Any = type(optimizer.__class__.__name__, (_Distributed, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped.mpigrad_setup(backward_passes_per_step, reducer_options)
    return wrapped


def parameter_tree(params: Any) -> Any:
    """``params`` as a pytree of tensors: a ``state_dict()`` as it is,
    ``named_parameters()`` pairs or tensors as a list of the tensors."""
    if isinstance(params, dict):
        return params
    return [t[1] if isinstance(t, tuple) else t for t in params]


def broadcast_parameters(params: Any, root: int = 0, comm: Any = None) -> None:
    """Overwrite ``params`` with ``root``'s, in place: a ``state_dict()``,
    ``named_parameters()`` pairs, or tensors (buffers such as BatchNorm's
    counters included); over ``comm`` (default COMM_WORLD)."""
    with torch.no_grad():
        broadcast(parameter_tree(params), root=root, comm=comm)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0,
                              comm: Any = None) -> None:
    """Give every rank ``root``'s optimizer state and parameter-group options
    (lr, momentum, betas, ... with their python types), as ``load_state_dict``
    restores them; ranks that have not stepped yet need no state of their own.
    Over ``comm`` (default COMM_WORLD)."""
    optimizer.load_state_dict(broadcast_object(optimizer.state_dict(), root=root, comm=comm))

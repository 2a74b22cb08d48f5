"""The one base of mpigrad's torch optimizer wrappers (DistributedOptimizer,
ShardedOptimizer): the factory that makes a wrapped optimizer, and the small
object a wrapped optimizer holds of mpigrad (``Wrapper``): its reducer, its
parameters, their hooks, the steps taken, and what every step of both
wrappers shares (Horovod's ``synchronize`` / ``skip_synchronize`` and the
step around the optimizer's own)."""

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type, TypeVar

import torch

from ..reducer import Reducer

__all__ = ["Wrapped", "Wrapper", "wrap", "trainable", "keep_grad_in", "parameter_names"]


def keep_grad_in(param: torch.Tensor, buffer: torch.Tensor) -> None:
    """Make ``buffer`` hold ``param``'s gradient (zeros where it has none) and
    be it, where backward or the user replaced or dropped it: the wrappers'
    gradients live in memory of their own (bucket views, reduce-scatter
    buffers) from step to step."""
    if param.grad is None:
        buffer.zero_()
        param.grad = buffer
    elif param.grad is not buffer:
        buffer.copy_(param.grad.to_dense() if param.grad.is_sparse else param.grad)
        param.grad = buffer


def trainable(param_groups: List[Dict[str, Any]]
              ) -> Tuple[List[torch.Tensor], List[int], List[Tuple[torch.Tensor, str]]]:
    """(the parameters that take gradients, each once, in group order; each
    one's group; those left out, as Horovod leaves them: without
    ``requires_grad`` (frozen layers, integer counters), with where they are)."""
    seen, params, groups, left_out = set(), [], [], []
    for g, group in enumerate(param_groups):
        for k, p in enumerate(group["params"]):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                params.append(p)
                groups.append(g)
            else:
                left_out.append((p, f"param_groups[{g}]['params'][{k}]"))
    return params, groups, left_out


def parameter_names(param_groups: List[Dict[str, Any]],
                    named: Optional[List[Tuple[str, torch.Tensor]]]) -> Dict[torch.Tensor, str]:
    """Every parameter's name: from ``named`` ((name, parameter) pairs, as
    ``model.named_parameters()`` gives), else Horovod's
    ``allreduce.noname.<group>.<index>``."""
    if named is not None:
        return {p: name for name, p in named}
    return {p: f"allreduce.noname.{g}.{i}" for g, group in enumerate(param_groups)
            for i, p in enumerate(group["params"])}


class Wrapper:
    """What a wrapped optimizer holds of mpigrad (its one attribute): the
    Reducer, the parameters it reduces, their hooks and the steps taken.
    Subclasses are each wrapper's step (see Wrapped).

    Args:
        optimizer: the wrapped optimizer.
        reducer_options: for mpigrad.Reducer (``check_finite`` defaults to
            True here, for ``finite``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, reducer_options: Dict[str, Any],
                 named_parameters: Optional[List[Tuple[str, torch.Tensor]]] = None) -> None:
        self.optimizer = optimizer
        self.names = parameter_names(optimizer.param_groups, named_parameters)
        self.reducer = Reducer(**{"check_finite": True, **reducer_options})
        self.steps = 0                   # steps taken: agreed when a reduction starts
        self.skip = False                # inside skip_synchronize()
        self.hooks: Dict[int, List[Any]] = {}  # id(param) -> its hooks' handles

    def hook(self, params: List[torch.Tensor]) -> None:
        """Call ``gradient_ready(param)`` as backward finishes each of
        ``params`` that has no hook yet."""
        for p in params:
            if id(p) not in self.hooks:
                self.hooks[id(p)] = [p.register_post_accumulate_grad_hook(self.gradient_ready)]

    @property
    def agreed_steps(self) -> Dict[str, int]:
        """The steps taken, as every rank must have taken them alike (a rank
        that reduced twice in a step, or skipped one, is found)."""
        return {"optimizer steps taken": self.steps}

    def gradient_ready(self, param: torch.Tensor) -> None:
        """Backward finished ``param``'s gradient."""

    def synchronize(self) -> None:
        """Finish the gradient reduction now."""
        raise NotImplementedError

    def step(self, closure: Optional[Callable[[], Any]],
             step: Callable[[Optional[Callable[[], Any]]], Any]) -> Any:
        """Reduce (unless inside skip_synchronize), then ``step`` (the
        optimizer's own) with ``closure``."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool) -> None:
        """Zero the gradients, finishing a reduction in progress first."""
        raise NotImplementedError

    def free(self) -> None:
        """Remove the hooks and free the reducer."""
        for handles in self.hooks.values():
            for handle in handles:
                handle.remove()
        self.reducer.free()


class Wrapped(torch.optim.Optimizer):
    """Mixed into a wrapped optimizer's class, before the optimizer's own:
    the methods torch users call, each a call of the optimizer's Wrapper."""

    mpigrad: Wrapper

    def synchronize(self) -> None:
        """Finish the gradient reduction now (before GradScaler.unscale_ or
        clipping); then step inside ``skip_synchronize()``."""
        self.mpigrad.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not reduce again (after synchronize())."""
        self.mpigrad.skip = True
        try:
            yield
        finally:
            self.mpigrad.skip = False

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Wait for the reduction (unless inside skip_synchronize), then step."""
        return self.mpigrad.step(closure, super().step)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (either way: they keep their memory)."""
        self.mpigrad.zero_grad(set_to_none)

    @property
    def finite(self) -> Optional[bool]:
        """After the reduction: every reduced gradient is finite, on every rank
        alike (None if the reducer was built with check_finite=False)."""
        return self.mpigrad.reducer.finite

    @property
    def _parameter_names(self) -> Dict[torch.Tensor, str]:
        """Horovod's attribute: {parameter: its name} (see ``parameter_names``)."""
        return self.mpigrad.names

    @property
    def reducer(self) -> Reducer:
        """The Reducer behind this optimizer."""
        return self.mpigrad.reducer

    def free(self) -> None:
        """Remove the hooks and free the reducer."""
        self.mpigrad.free()


_O = TypeVar("_O", bound=torch.optim.Optimizer)


def wrap(optimizer: _O, mixin: Type[Wrapped], make: Callable[[Wrapped], Wrapper]) -> _O:
    """``optimizer`` as an instance of a subclass of its class with ``mixin``
    before it, sharing its state and parameter groups (so that GradScaler and
    LR schedulers accept it), holding the Wrapper ``make(wrapped)``."""
    kind: Any = type(optimizer.__class__.__name__, (mixin, optimizer.__class__), {})
    wrapped = kind.__new__(kind)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped.mpigrad = make(wrapped)
    return wrapped

"""What both torch optimizer wrappers (DistributedOptimizer,
ShardedOptimizer) share: Horovod's ``skip_synchronize()``, the agreed
``finite`` flag, the ``reducer``, and how a gradient is kept in its buffer."""

import contextlib
from typing import Iterator, Optional

import torch

from .reducer import Reducer

__all__ = ["Wrapped", "keep_grad_in"]


def keep_grad_in(param: torch.Tensor, buffer: torch.Tensor) -> None:
    """Make ``buffer`` hold ``param``'s gradient (zeros where it has none) and
    be it, where backward or the user replaced or dropped it: the wrappers'
    gradients live in memory of their own (bucket views, reduce-scatter
    buffers) from step to step."""
    if param.grad is None:
        buffer.zero_()
        param.grad = buffer
    elif param.grad is not buffer:
        buffer.copy_(param.grad)
        param.grad = buffer


class Wrapped(torch.optim.Optimizer):
    """Mixed into both wrappers (before the optimizer's own class)."""

    _mp_reducer: Reducer
    _mp_skip: bool          # inside skip_synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not reduce again (after synchronize())."""
        self._mp_skip = True
        try:
            yield
        finally:
            self._mp_skip = False

    @property
    def finite(self) -> Optional[bool]:
        """After the reduction: every reduced gradient is finite, on every rank
        alike (None if the reducer was built with check_finite=False)."""
        return self._mp_reducer.finite

    @property
    def reducer(self) -> Reducer:
        """The Reducer behind this optimizer."""
        return self._mp_reducer

"""What both torch optimizer wrappers (DistributedOptimizer,
ShardedOptimizer) offer alike: Horovod's ``skip_synchronize()``, the agreed
``finite`` flag, the ``reducer``."""

import contextlib
from typing import Iterator, Optional

import torch

from .reducer import Reducer

__all__ = ["Wrapped"]


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

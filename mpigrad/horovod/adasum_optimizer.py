"""Horovod's ``DistributedOptimizer(op=hvd.Adasum)``: each rank steps its
own optimizer on its own gradients, then the ranks' parameter deltas are
combined by Adasum, tensor by tensor, and every rank ends at its start plus
the combined delta (Horovod's Adasum optimizer, without its per-parameter
hooks: the deltas are reduced together in ``step``)."""

from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch

__all__ = ["AdasumOptimizer"]


class AdasumOptimizer:
    """Wraps ``optimizer``; ``combine`` is the Adasum of a list of tensors
    across the ranks (``hvd.grouped_allreduce(op=hvd.Adasum)``). Every other
    attribute is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 combine: Callable[[Sequence[torch.Tensor]], List[torch.Tensor]]) -> None:
        self.optimizer = optimizer
        self.combine = combine

    def _parameters(self) -> List[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]
                if p.requires_grad]

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """The local step, then every rank moves by the Adasum of the deltas
        (collective: every rank calls it, with the same parameters)."""
        params = self._parameters()
        with torch.no_grad():
            starts = [p.detach().clone() for p in params]
        loss = self.optimizer.step(closure)
        with torch.no_grad():
            try:
                combined = self.combine([p.detach() - s for p, s in zip(params, starts)])
            except BaseException:          # the parameters as they were (its state moved)
                for p, start in zip(params, starts):
                    p.copy_(start)
                raise
            for p, start, delta in zip(params, starts, combined):
                p.copy_(start + delta)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Nothing to wait for: the deltas are combined inside ``step``."""

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """As Horovod's (``step`` combines the deltas itself)."""
        yield

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

"""The training state's broadcasts: every rank starts from the root's
parameters (and buffers) and optimizer state."""

from typing import Any

import torch

from ..collectives import broadcast, broadcast_object

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "parameter_tree"]


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

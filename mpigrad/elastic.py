"""The training-loop side of surviving a lost rank, as Horovod Elastic users
know it, for any framework: a State of the trainer's pytree that can be
committed, restored and synced, and ``run``, which re-enters the training
function after RanksLost with the state restored and synced.

    reducer = mpigrad.Reducer(on_failure="shrink")
    state = mpigrad.elastic.State({"params": params, "step": 0}, reducer)
    state.on_reset(lambda state, lost: reshard(reducer.comm.size))

    def train(state):
        while state.tree["step"] < steps:
            ...  # reducer.reduce(...), update state.tree in place or by assignment
            state.tree["step"] += 1
            state.commit()

    mpigrad.elastic.run(train, state)

Launch with ``mpiexec --with-ft ulfm --mca btl tcp,self ...`` (Open MPI 5).
"""

from typing import Any, Callable, List, Optional, Protocol, TypeVar

import numpy as np

from ._base.errors import RanksLost
from ._base.tree import flatten_all, unflatten

__all__ = ["State", "Recoverable", "run"]


def _copy(leaf: Any) -> Any:
    """A private copy of one leaf (immutable ones are shared)."""
    if isinstance(leaf, np.ndarray):
        return leaf.copy()
    clone = getattr(leaf, "clone", None)             # torch
    if callable(clone) and type(leaf).__module__.startswith("torch"):
        return leaf.detach().clone()
    copy = getattr(leaf, "copy", None)               # cupy; jax arrays are immutable
    if callable(copy) and type(leaf).__module__.startswith("cupy"):
        return leaf.copy()
    return leaf


def _write_back(current: Any, saved: Any) -> Any:
    """``saved`` into ``current`` in place where it can be (so that what
    references the array, an optimizer, sees it); else a copy of ``saved``."""
    if (isinstance(current, np.ndarray) and current.flags.writeable
            and current.shape == saved.shape and current.dtype == saved.dtype):
        current[...] = saved
        return current
    if type(current).__module__.startswith("torch") and hasattr(current, "copy_") \
            and getattr(current, "shape", None) == getattr(saved, "shape", None):
        current.detach().copy_(saved)
        return current
    return _copy(saved)


class State:
    """The trainer's state (a pytree: parameters, optimizer state, step,
    epoch, ...) and its last committed copy.

    Args:
        tree: the pytree; ``state.tree`` is it, to read and update.
        reducer: the Reducer whose communicator ``sync`` broadcasts over.
    """

    def __init__(self, tree: Any, reducer: Any) -> None:
        self.tree = tree
        self.reducer = reducer
        self._callbacks: List[Callable[["State", RanksLost], None]] = []
        self._saved: Any = None          # (spec, leaves) of the last commit
        self.commit()

    def commit(self) -> None:
        """Keep a private copy of the tree (local: no communication)."""
        leaves, spec = flatten_all(self.tree)
        self._saved = (spec, [_copy(leaf) for leaf in leaves])

    def restore(self) -> None:
        """Put the tree back to the last commit: arrays in place where they
        can be (parameters an optimizer holds stay the same objects)."""
        spec, saved = self._saved
        leaves, current_spec = flatten_all(self.tree)
        if current_spec != spec or len(leaves) != len(saved):
            self.tree = unflatten(spec, [_copy(leaf) for leaf in saved])
            return
        self.tree = unflatten(spec, [_write_back(c, s) for c, s in zip(leaves, saved)])

    def sync(self) -> None:
        """Every rank takes rank 0's tree (after a shrink, the lowest
        survivor's) over the reducer's communicator, and commits it."""
        self.tree = self.reducer.broadcast(self.tree, root=0)
        self.commit()

    def on_reset(self, callback: Callable[["State", RanksLost], None]) -> None:
        """Call ``callback(state, lost)`` after every reset (restore and sync
        on the survivors): re-shard the data, rescale the learning rate."""
        self._callbacks.append(callback)

    def reset(self, lost: RanksLost) -> None:
        """After RanksLost: restore, sync, then the callbacks."""
        self.restore()
        self.sync()
        for callback in self._callbacks:
            callback(self, lost)


class Recoverable(Protocol):
    """What ``run`` needs of a training state: ``sync`` every rank to rank
    0's, and ``reset`` after a lost rank (restore the last commit, sync it,
    tell the trainer). mpigrad.elastic.State and hvd.elastic's states are."""

    def sync(self) -> None: ...

    def reset(self, lost: RanksLost) -> None: ...


_S = TypeVar("_S", bound=Recoverable)


def run(train_fn: Callable[[_S], Any], state: _S) -> Any:
    """Call ``train_fn(state)`` (every rank starting from rank 0's state) and
    return what it returns; after a lost rank (RanksLost, from a Reducer or
    a collective), reset the state on the survivors and call it again; a
    rank lost during the reset starts the reset again."""
    lost: Optional[RanksLost] = None
    while True:
        try:
            if lost is None:
                state.sync()
            else:
                state.reset(lost)
            return train_fn(state)
        except RanksLost as again:
            lost = again

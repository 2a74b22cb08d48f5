"""``hvd.elastic`` (Horovod's torch elastic API) on mpigrad: a lost rank in a
job launched with fault tolerance (``mpiexec --with-ft ulfm --mca btl
tcp,self ...``, Open MPI 5) shrinks the job to the survivors, which restore
the last commit and go on.

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

Without fault tolerance a lost rank ends the job, as mpigrad's watch does.
"""

import copy
import functools
from typing import Any, Callable, Dict, List, Optional

import torch

from .. import elastic
from .._base.errors import RanksLost
from . import core

__all__ = ["State", "ObjectState", "TorchState", "run"]


class State:
    """What is committed, restored and synced; ``register_reset_callbacks``
    run after every reset (a shrink), on every survivor. A
    mpigrad.elastic.Recoverable: ``run`` is mpigrad.elastic.run."""

    def __init__(self) -> None:
        self._callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        self._callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._callbacks:
            callback()

    def commit(self) -> None:
        """Keep a copy to restore after a lost rank (local: no communication)."""
        self.save()

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self, lost: RanksLost) -> None:
        """After a lost rank: the job follows the survivors (where the
        optimizer's Reducer, not a Horovod collective, saw the loss), then
        Horovod's order: restore, the reset callbacks, sync."""
        if not isinstance(lost, core.HorovodInternalError):
            core.shrink_job()
        self.restore()
        self.on_reset()
        self.sync()


class ObjectState(State):
    """Picklable values (``ObjectState(epoch=0, batch=0)``), attributes of the
    state; synced from rank 0."""

    def __init__(self, bcast_object: Optional[Callable[..., Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        super().__init__()
        self._bcast = bcast_object or _broadcast_object
        self._names = list(kwargs)
        self._saved: Dict[str, Any] = {}
        for name, value in kwargs.items():
            setattr(self, name, value)
        self.save()

    def save(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._names}

    def restore(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        if self._names:
            values = self._bcast({name: getattr(self, name) for name in self._names},
                                 root_rank=0)
            for name, value in values.items():
                setattr(self, name, value)
            self.save()


class TorchState(ObjectState):
    """A model, an optimizer and picklable values: ``commit`` copies their
    state dicts, ``restore`` loads them back, ``sync`` gives every rank rank
    0's (the tensors in place)."""

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, **kwargs: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self._model_saved: Any = None
        self._optimizer_saved: Any = None
        super().__init__(**kwargs)

    def save(self) -> None:
        super().save()
        if self.model is not None:
            self._model_saved = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._optimizer_saved = copy.deepcopy(self.optimizer.state_dict())

    def restore(self) -> None:
        super().restore()
        if self.model is not None:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._optimizer_saved)

    def sync(self) -> None:
        if self.model is not None:
            with torch.no_grad():
                core.broadcast_tree(self.model.state_dict(), 0, core.global_process_set)
        if self.optimizer is not None:
            first = core.world().rank == 0
            state = _broadcast_object(self.optimizer.state_dict() if first else None, 0)
            if not first:
                self.optimizer.load_state_dict(state)
        super().sync()


def _broadcast_object(obj: Any, root_rank: int) -> Any:
    return core.broadcast_object(obj, root_rank, core.global_process_set)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``func(state, ...)``: it runs from rank 0's state (synced);
    after a lost rank (HorovodInternalError from a collective, RanksLost from
    the optimizer), the survivors restore the last commit, run the reset
    callbacks, sync and call it again (mpigrad.elastic.run)."""
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        return elastic.run(lambda state: func(state, *args, **kwargs), state)
    return wrapper

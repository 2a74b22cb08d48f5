"""torch optimizers on a shard of the parameters (ZeRO-2 on MPI): ShardedOptimizer.

    opt = mpigrad.torch.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    loss.backward()
    opt.step()            # reduce-scatter, the optimizer on this rank's shard, allgather
    opt.zero_grad()

Each rank owns a balanced, contiguous shard of the fused parameter space
(``Reducer.shards``). It keeps a master copy of that shard in the wire dtype
(float32 for half-precision parameters) and the wrapped optimizer's state for
it alone: the optimizer's parameter groups hold 1-D pieces of the master
shard, one per parameter range the rank owns. A step reduce-scatters the
gradients (the full mean gradient is never made), steps the optimizer on the
pieces, and gathers the updated shards into the parameters. Any optimizer
whose update is elementwise per parameter (SGD with momentum, Adam, AdamW,
RMSprop, Adagrad, ...) gives the unsharded optimizer's parameters; one that
mixes a parameter's elements (LBFGS, factored second moments) does not.

``state_dict()`` is torch's format for the full, unsharded optimizer (gathered
on every rank): it loads into a plain torch optimizer, and into a
ShardedOptimizer at any world size, which takes its shard of it.
"""

from collections import defaultdict
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from ._base.arrays import numpy_from_torch, torch_from_numpy
from ._base.dtypes import assign
from .reducer import Reducer
from .shard import gathered_whole
from .torch_wrapped import Wrapped, keep_grad_in

__all__ = ["ShardedOptimizer"]


def _elementwise(key: str, value: Any, shape: Any) -> bool:
    """Whether the state ``value`` holds one number per element of a
    parameter of ``shape`` (exp_avg, momentum_buffer, ...; "step" is a count)."""
    return key != "step" and torch.is_tensor(value) and tuple(value.shape) == tuple(shape)


def _set_elements(array: np.ndarray, first: int, stop: int, values: np.ndarray) -> None:
    """Write ``values`` (cast) into ``array``'s elements [first, stop) in C order."""
    if array.flags.c_contiguous:
        assign(array.reshape(-1)[first:stop], values)
    else:
        array[np.unravel_index(np.arange(first, stop), array.shape)] = values.astype(array.dtype)


class _Piece:
    """One parameter range this rank owns: parameter ``index``'s flat
    elements [first, stop), stepped as ``tensor``: a 1-D view of the
    parameter itself, or of ``master``, a copy in the wire dtype (float32
    for a half-precision parameter), kept from step to step."""

    __slots__ = ("index", "first", "stop", "tensor", "master")

    def __init__(self, index: int, first: int, stop: int, tensor: torch.Tensor,
                 master: Optional[np.ndarray]) -> None:
        self.index, self.first, self.stop = index, first, stop
        self.tensor, self.master = tensor, master


class _Sharded(Wrapped):
    """The methods a sharded optimizer gains (mixed into a subclass of its
    class: the MRO is this, the optimizer's class, then torch.optim.Optimizer)."""

    def mpigrad_setup(self, overlap: bool, reducer_options: Dict[str, Any]) -> None:
        self._mp_reducer = Reducer(**{"check_finite": True, **reducer_options})
        # the parameters as wrapped, per group (state_dict numbers them so)
        self._mp_groups = [list(group["params"]) for group in self.param_groups]
        params, group_of, seen = [], [], set()
        for g, members in enumerate(self._mp_groups):
            for p in members:
                if p.device.type != "cpu":
                    raise TypeError(f"ShardedOptimizer: expecting CPU parameters, got one on "
                                    f"{p.device}; use DistributedOptimizer for device tensors")
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
                    group_of.append(g)
        self._mp_params = params
        self._mp_group_of = group_of
        self._mp_views = [numpy_from_torch(p.detach()) for p in params]
        # the gradients live in buffers of their own from step to step, so
        # that each is read where backward wrote it, as its bucket completes
        self._mp_buffers = [torch.zeros_like(p) for p in params]
        self._mp_grads = [numpy_from_torch(b) for b in self._mp_buffers]
        for p, buffer in zip(params, self._mp_buffers):
            keep_grad_in(p, buffer)
        self._mp_index = {id(p): i for i, p in enumerate(params)}
        self._mp_overlap = overlap
        self._mp_pending: Any = None       # this step's PendingShards
        self._mp_marked: set = set()
        self._mp_hooks = [p.register_post_accumulate_grad_hook(self._mp_hook)
                          for p in params] if overlap else []
        full_state = {p: self.state[p] for p in params if p in self.state}
        self._mp_place()
        self._mp_shard_state(full_state)
        self._mp_steps = 0
        self._mp_synchronized = False
        self._mp_skip = False

    def _mp_place(self) -> None:
        """Cut this rank's pieces for the reducer's communicator as it is now
        (after a shrink, the survivors'); they become the parameter groups'
        parameters, with no state yet."""
        comm = self._mp_reducer.comm
        self._mp_placed = (comm.Get_rank(), comm.Get_size())
        self._mp_pieces: Dict[np.dtype, List[_Piece]] = {}
        for dtype, ranges in self._mp_reducer.shards(self._mp_views).items():
            self._mp_pieces[dtype] = [self._mp_piece(dtype, *r) for r in ranges]
        for g, group in enumerate(self.param_groups):
            group["params"] = [piece.tensor for piece in self._mp_all_pieces()
                               if self._mp_group_of[piece.index] == g]
        self.state = defaultdict(dict)

    def _mp_piece(self, dtype: np.dtype, index: int, first: int, stop: int) -> _Piece:
        """The piece of parameter ``index`` [first, stop): stepped in the
        parameter itself where it is of the wire dtype and contiguous."""
        param = self._mp_params[index]
        if self._mp_views[index].dtype == dtype and param.is_contiguous():
            return _Piece(index, first, stop, param.detach().view(-1)[first:stop], None)
        master = self._mp_flat(index)[first:stop].astype(dtype)
        return _Piece(index, first, stop, torch_from_numpy(master), master)

    def _mp_all_pieces(self) -> Iterator[_Piece]:
        for pieces in self._mp_pieces.values():
            yield from pieces

    def _mp_flat(self, index: int) -> np.ndarray:
        """Parameter ``index``'s elements in C order (a view where it is contiguous)."""
        return np.ravel(self._mp_views[index])

    def _mp_masters(self) -> Iterator[Tuple[_Piece, np.ndarray]]:
        """(piece, its parameter elements) of the pieces stepped in a master copy."""
        for piece in self._mp_all_pieces():
            if piece.master is not None:
                yield piece, self._mp_flat(piece.index)[piece.first:piece.stop]

    def _mp_refresh_masters(self) -> None:
        """Take the parameters' values into the master copies where they were
        changed since the last step (a load, a broadcast after wrapping): the
        parameters are the truth; a master keeps its extra bits otherwise."""
        for piece, values in self._mp_masters():
            assert piece.master is not None
            if not np.array_equal(piece.master.astype(values.dtype), values):
                piece.master[...] = values

    # -- state: sharded here, whole in state_dict ---------------------------
    def _mp_shard_state(self, full: Dict[torch.Tensor, Dict[str, Any]]) -> None:
        """Set this rank's state from ``full`` (per parameter: torch's state of
        the whole parameter): its pieces of elementwise values, scalars copied."""
        for piece in self._mp_all_pieces():
            state = full.get(self._mp_params[piece.index])
            if state is None:
                continue
            param = self._mp_params[piece.index]
            mine = {}
            for key, value in state.items():
                if _elementwise(key, value, param.shape):
                    part = value.detach().reshape(-1)[piece.first:piece.stop]
                    mine[key] = part.to(dtype=piece.tensor.dtype, copy=True)
                else:
                    mine[key] = value.clone() if torch.is_tensor(value) else value
            self.state[piece.tensor] = mine

    def _mp_gather_state(self) -> Dict[int, Dict[str, Any]]:
        """{parameter index (as wrapped): its whole state} (collective)."""
        scalars: Dict[int, Dict[str, Any]] = {}
        elementwise: Dict[str, None] = {}
        for piece in self._mp_all_pieces():
            for key, value in self.state.get(piece.tensor, {}).items():
                if _elementwise(key, value, piece.tensor.shape):
                    elementwise[key] = None
                else:
                    scalars.setdefault(piece.index, {})[key] = value
        merged: Dict[int, Dict[str, Any]] = {}
        keys: Dict[str, None] = {}
        for theirs, their_keys in self._mp_reducer.allgather_object((scalars,
                                                                     list(elementwise))):
            for index, values in theirs.items():
                merged.setdefault(index, {}).update(values)
            keys.update(dict.fromkeys(their_keys))
        for key in keys:
            shards = {dtype: self._mp_state_shard(dtype, pieces, key)
                      for dtype, pieces in self._mp_pieces.items()}
            whole = gathered_whole(self._mp_reducer, shards, self._mp_views)
            for index, array in enumerate(whole):
                merged.setdefault(index, {})[key] = torch_from_numpy(array)
        return merged

    def _mp_state_shard(self, dtype: np.dtype, pieces: List[_Piece], key: str) -> np.ndarray:
        parts = []
        for piece in pieces:
            value = self.state.get(piece.tensor, {}).get(key)
            if value is None:
                raise RuntimeError(f"state_dict: parameter {piece.index} has no {key!r} "
                                   "state where others have it; step every parameter alike")
            parts.append(numpy_from_torch(value.detach()).astype(dtype, copy=False))
        return np.concatenate(parts) if parts else np.empty(0, dtype)

    def state_dict(self) -> Dict[str, Any]:
        """torch's state_dict of the whole, unsharded optimizer (collective:
        every rank gets it; save it on one): it loads into this optimizer at
        any world size, and into the plain torch optimizer."""
        numbering: Dict[int, int] = {}
        groups = []
        for group, params in zip(self.param_groups, self._mp_groups):
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = []
            for p in params:
                numbering.setdefault(id(p), len(numbering))
                saved["params"].append(numbering[id(p)])
            groups.append(saved)
        state = {numbering[id(self._mp_params[index])]: values
                 for index, values in self._mp_gather_state().items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load torch's state_dict of the whole optimizer (``state_dict()``
        at any world size, or a plain torch optimizer's): this rank keeps its
        shard of it; the groups' options (lr, betas, ...) are restored. After
        RanksLost (``on_failure="shrink"``), this reshards over the survivors:
        load the last committed state_dict (mpigrad.elastic.State)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self._mp_groups) or any(
                len(s["params"]) != len(p) for s, p in zip(saved_groups, self._mp_groups)):
            raise ValueError(
                "load_state_dict: expecting parameter groups of sizes "
                f"{[len(p) for p in self._mp_groups]}, got "
                f"{[len(s['params']) for s in saved_groups]}")
        by_id = {}
        for saved, params in zip(saved_groups, self._mp_groups):
            for number, p in zip(saved["params"], params):
                by_id[id(p)] = number
        full = {}
        for p in self._mp_params:
            values = state_dict["state"].get(by_id[id(p)])
            if values is not None:
                full[p] = values
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        comm = self._mp_reducer.comm
        if self._mp_placed != (comm.Get_rank(), comm.Get_size()):
            self._mp_place()                 # ranks were lost: reshard
        self.state = defaultdict(dict)
        self._mp_shard_state(full)

    # -- the step --------------------------------------------------------------
    def _mp_keep(self, index: int) -> None:
        """Put parameter ``index``'s gradient back in its buffer (zeros where
        it has none) if backward or the user replaced it."""
        keep_grad_in(self._mp_params[index], self._mp_buffers[index])

    def _mp_hook(self, param: torch.Tensor) -> None:
        """Backward finished ``param``'s gradient: its bucket goes out once complete."""
        index = self._mp_index[id(param)]
        if self._mp_synchronized:
            return
        if index in self._mp_marked:
            raise RuntimeError(
                "ShardedOptimizer: a second backward pass before step(): its gradients "
                "were already sent; wrap with overlap=False to accumulate several passes")
        if self._mp_pending is None:
            for i in range(len(self._mp_params)):
                self._mp_keep(i)
            self._mp_pending = self._mp_reducer.start_reduce_scatter(
                self._mp_grads, agree={"optimizer steps taken": self._mp_steps})
        else:
            self._mp_keep(index)
        self._mp_marked.add(index)
        self._mp_pending.ready(index)

    def synchronize(self) -> None:
        """Finish the reduce-scatter of the gradients: this rank's shard of
        their mean becomes the gradients of its pieces (before clipping);
        then step inside ``skip_synchronize()``."""
        if self._mp_synchronized:
            return
        for i in range(len(self._mp_params)):
            self._mp_keep(i)
        pending, self._mp_pending = self._mp_pending, None
        self._mp_marked.clear()
        agree = {"optimizer steps taken": self._mp_steps}
        if pending is None and not self._mp_overlap:
            shards = self._mp_reducer.reduce_scatter(self._mp_grads, agree=agree)
        else:      # (a rank without a backward pass this step still calls alike)
            if pending is None:
                pending = self._mp_reducer.start_reduce_scatter(self._mp_grads, agree=agree)
            shards = pending.wait()
        for dtype, pieces in self._mp_pieces.items():
            offset = 0
            for piece in pieces:
                size = piece.stop - piece.first
                piece.tensor.grad = torch_from_numpy(shards[dtype][offset:offset + size])
                offset += size
        if self._mp_reducer.finite is False:
            # a value of the mean gradient is not finite, in some rank's
            # shard: every rank's shard says so, so that GradScaler (which
            # looks at this rank's shard alone) skips the step everywhere
            for piece in self._mp_all_pieces():
                assert piece.tensor.grad is not None
                piece.tensor.grad.fill_(float("inf"))
        self._mp_synchronized = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the reduced gradients so that their global norm is at most
        ``max_norm`` (torch.nn.utils.clip_grad_norm_ of the full mean
        gradient; one tiny allreduce of the shards' norms); return the norm
        before clipping. Synchronizes first."""
        self.synchronize()
        grads = [numpy_from_torch(piece.tensor.grad) for piece in self._mp_all_pieces()]
        if math.isinf(norm_type):
            local = max((float(np.max(np.abs(g))) for g in grads if g.size), default=0.0)
            total = self._mp_reducer.allreduce(local, op="max")
        else:
            local = sum(float(np.sum(np.abs(g.astype(np.float64)) ** norm_type)) for g in grads)
            total = self._mp_reducer.allreduce(local, op="sum") ** (1.0 / norm_type)
        factor = max_norm / (total + 1e-6)
        if factor < 1.0:
            with np.errstate(all="ignore"):      # inf * 0 is nan, as in torch's
                for g in grads:
                    g *= g.dtype.type(factor)
        return torch.tensor(total)

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state (its tensors)."""
        return sum(v.numel() * v.element_size() for state in self.state.values()
                   for v in state.values() if torch.is_tensor(v))

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Reduce-scatter (unless inside skip_synchronize), step the optimizer
        on this rank's shard, gather the parameters (collective)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._mp_skip:
            self.synchronize()
        try:
            self._mp_refresh_masters()
            super().step()
            params = [p.detach() for p in self._mp_params]
            for piece, _ in self._mp_masters():        # then as if stepped in place
                assert piece.master is not None
                _set_elements(self._mp_views[piece.index], piece.first, piece.stop,
                              piece.master)
            # each rank's shard is in its parameters: the others' are gathered
            self._mp_reducer.allgather_shards(None, into=params)
            self._mp_steps += 1
        finally:
            self._mp_synchronized = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the parameters' gradients (either way: they keep their
        buffers) and drop the shard's."""
        if self._mp_pending is not None and not self._mp_synchronized:
            self.synchronize()             # finish what was started: every rank alike
        for p, buffer in zip(self._mp_params, self._mp_buffers):
            buffer.zero_()
            p.grad = buffer
        for piece in self._mp_all_pieces():
            piece.tensor.grad = None
        self._mp_synchronized = False

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise NotImplementedError("ShardedOptimizer: add parameter groups to the torch "
                                  "optimizer before wrapping it")

    def free(self) -> None:
        """Remove the hooks and free the reducer."""
        for handle in self._mp_hooks:
            handle.remove()
        self._mp_reducer.free()


def ShardedOptimizer(optimizer: torch.optim.Optimizer, *, overlap: bool = True,
                     **reducer_options: Any) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that each rank steps it on its shard of the
    parameters only, with the gradients' mean over the ranks (ZeRO-2: see
    the module).

    Collective: every rank wraps its optimizer, over the same parameters
    (broadcast them first, or after: the parameters are read again at every
    step). Each bucket of gradients is reduce-scattered as soon as backward
    has finished it (``overlap=True``: one backward pass per step; with
    ``overlap=False``, all in ``step()``, after any number of passes).
    ``step()`` finishes the reduce-scatter, steps, and gathers the parameters;
    ``synchronize()``, ``skip_synchronize()`` and ``clip_grad_norm_()`` serve
    clipping, and GradScaler: ``synchronize()``, ``scaler.unscale_(opt)``,
    ``opt.clip_grad_norm_(...)``, then ``scaler.step(opt)`` inside
    ``skip_synchronize()`` (where the mean gradient is not finite anywhere,
    every rank's shard gradients are made inf: every rank skips the step). A
    parameter without a gradient in a step counts as zero; ones with
    ``requires_grad=False`` when wrapped are left out. CPU parameters.
    ``reducer_options`` go to ``mpigrad.Reducer`` (``check_finite`` defaults
    to True, for ``finite``).

    Returns an optimizer of a subclass of ``optimizer``'s class sharing its
    parameter groups (LR schedulers accept it), whose state is this rank's shard.
    """
    cls: Any = type(optimizer.__class__.__name__, (_Sharded, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped.mpigrad_setup(overlap, reducer_options)
    return wrapped

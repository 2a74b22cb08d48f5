"""torch optimizers on a shard of the parameters (ZeRO-2 on MPI): ShardedOptimizer.

    opt = mpigrad.torch.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    loss.backward()
    opt.step()            # reduce-scatter, the optimizer on this rank's shard, allgather
    opt.zero_grad()

It runs on mpigrad's one ZeRO core (mpigrad.shard.Sharded) through a
per-parameter adapter: each rank owns a balanced, contiguous shard of the
fused parameter space, cut into pieces, one per parameter range it owns;
the wrapped optimizer's parameter groups hold the pieces as 1-D tensors (a
view of the parameter itself where it is of the wire dtype and contiguous,
else of a float32 master copy), and its state covers them alone. A step
reduce-scatters the gradients (the full mean gradient is never made), steps
the optimizer on the pieces, and gathers the updated shards into the
parameters. Any optimizer whose update is elementwise per parameter (SGD
with momentum, Adam, AdamW, RMSprop, Adagrad, ...) gives the unsharded
optimizer's parameters; one that mixes a parameter's elements (LBFGS,
factored second moments) does not.

``state_dict()`` is torch's format for the full, unsharded optimizer (gathered
on every rank): it loads into a plain torch optimizer, and into a
ShardedOptimizer at any world size, which takes its shard of it.
"""

import math
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from .._base.arrays import numpy_from_torch, torch_from_numpy
from ..reducer import PendingShards
from ..shard import Piece, Sharded
from .wrapper import Wrapped, Wrapper, keep_grad_in, trainable, wrap

__all__ = ["ShardedOptimizer"]


def _elementwise(key: str, value: Any, shape: Any) -> bool:
    """Whether the state ``value`` holds one number per element of a
    parameter of ``shape`` (exp_avg, momentum_buffer, ...; "step" is a count)."""
    return key != "step" and torch.is_tensor(value) and tuple(value.shape) == tuple(shape)


class _ShardedStep(Wrapper):
    """A ShardedOptimizer's step, on the ZeRO core over its parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, overlap: bool,
                 reducer_options: Dict[str, Any]) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.device.type != "cpu":
                    raise TypeError(f"ShardedOptimizer: expecting CPU parameters, got one on "
                                    f"{p.device}; use DistributedOptimizer for device tensors")
        super().__init__(optimizer, reducer_options)
        # the parameters as wrapped, per group (state_dict numbers them so)
        self.groups = [list(group["params"]) for group in optimizer.param_groups]
        self.params, self.group_of, _ = trainable(optimizer.param_groups)
        self.shapes = self.param_shapes()            # as wrapped
        # the gradients live in buffers of their own from step to step, so
        # that each is read where backward wrote it, as its bucket completes
        self.buffers = [torch.zeros_like(p) for p in self.params]
        self.grads = [numpy_from_torch(b) for b in self.buffers]
        self.keep_all()
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.overlap = overlap
        self.pending: Optional[PendingShards] = None   # this step's reduce-scatter
        self.marked: set = set()
        if overlap:
            self.hook(self.params)
        full_state = {p: optimizer.state[p] for p in self.params if p in optimizer.state}
        self.core = Sharded([p.detach() for p in self.params], reducer=self.reducer,
                            in_place=True)
        self.take_pieces()
        self.shard_state(full_state)
        self.synchronized = False

    # -- the pieces, as the optimizer's parameters --------------------------
    def take_pieces(self) -> None:
        """The core's pieces become the parameter groups' parameters, with no
        state yet."""
        self.tensors = {id(piece): torch_from_numpy(piece.values)
                        for piece in self.core.all_pieces()}
        for g, group in enumerate(self.optimizer.param_groups):
            group["params"] = [self.tensors[id(piece)] for piece in self.core.all_pieces()
                               if self.group_of[piece.index] == g]
        self.optimizer.state = defaultdict(dict)

    def tensor(self, piece: Piece) -> torch.Tensor:
        """The tensor the optimizer steps for ``piece``."""
        return self.tensors[id(piece)]

    # -- state: sharded here, whole in state_dict ---------------------------
    def shard_state(self, full: Dict[torch.Tensor, Dict[str, Any]]) -> None:
        """Set this rank's state from ``full`` (per parameter: torch's state of
        the whole parameter): its pieces of elementwise values, scalars copied."""
        for piece in self.core.all_pieces():
            param = self.params[piece.index]
            state = full.get(param)
            if state is None:
                continue
            mine = {}
            for key, value in state.items():
                if _elementwise(key, value, param.shape):
                    part = value.detach().reshape(-1)[piece.first:piece.stop]
                    mine[key] = part.to(dtype=self.tensor(piece).dtype, copy=True)
                else:
                    mine[key] = value.clone() if torch.is_tensor(value) else value
            self.optimizer.state[self.tensor(piece)] = mine

    def gather_state(self) -> Dict[int, Dict[str, Any]]:
        """{parameter index (as wrapped): its whole state} (collective)."""
        state = self.optimizer.state
        scalars: Dict[int, Dict[str, Any]] = {}
        elementwise: Dict[str, None] = {}
        for piece in self.core.all_pieces():
            tensor = self.tensor(piece)
            for key, value in state.get(tensor, {}).items():
                if _elementwise(key, value, tensor.shape):
                    elementwise[key] = None
                else:
                    scalars.setdefault(piece.index, {})[key] = value
        merged: Dict[int, Dict[str, Any]] = {}
        keys: Dict[str, None] = {}
        for theirs, their_keys in self.reducer.allgather_object((scalars, list(elementwise))):
            for index, values in theirs.items():
                merged.setdefault(index, {}).update(values)
            keys.update(dict.fromkeys(their_keys))
        for key in keys:
            whole = self.core.gathered(self.core.joined(lambda piece: self.state_of(piece, key)))
            for index, array in enumerate(whole):
                merged.setdefault(index, {})[key] = torch_from_numpy(array)
        return merged

    def state_of(self, piece: Piece, key: str) -> np.ndarray:
        """``piece``'s elementwise state ``key``, as numpy."""
        value = self.optimizer.state.get(self.tensor(piece), {}).get(key)
        if value is None:
            raise RuntimeError(f"state_dict: parameter {piece.index} has no {key!r} "
                               "state where others have it; step every parameter alike")
        return numpy_from_torch(value.detach())

    def state_dict(self, saved_groups: List[Dict[str, Any]]) -> Dict[str, Any]:
        numbering: Dict[int, int] = {}
        groups = []
        for group, params in zip(saved_groups, self.groups):
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = []
            for p in params:
                numbering.setdefault(id(p), len(numbering))
                saved["params"].append(numbering[id(p)])
            groups.append(saved)
        state = {numbering[id(self.params[index])]: values
                 for index, values in self.gather_state().items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take this rank's shard of ``state_dict`` (collective: it is checked
        on every rank, and every rank must load the same one)."""
        error: Optional[Exception] = None
        full: Dict[torch.Tensor, Dict[str, Any]] = {}
        summary: Dict[str, Any] = {}
        try:
            full, summary = self.loaded(state_dict)
        except Exception as exc:     # any local error: raised on every rank
            error = exc
        self.reducer.agree(summary, error=error)
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        comm = self.reducer.comm
        if self.core.placed != (comm.Get_rank(), comm.Get_size()):
            self.core.place()            # ranks were lost: reshard
            self.take_pieces()
        self.optimizer.state = defaultdict(dict)
        self.shard_state(full)

    def loaded(self, state_dict: Dict[str, Any]
               ) -> Tuple[Dict[torch.Tensor, Dict[str, Any]], Dict[str, Any]]:
        """(per parameter: its state in ``state_dict``, checked against it;
        what every rank must have loaded alike: the groups' sizes and every
        scalar of the state, by key)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.groups) or any(
                len(s["params"]) != len(p) for s, p in zip(saved_groups, self.groups)):
            raise ValueError(
                "load_state_dict: expecting parameter groups of sizes "
                f"{[len(p) for p in self.groups]}, got "
                f"{[len(s['params']) for s in saved_groups]}")
        by_id = {}
        for saved, params in zip(saved_groups, self.groups):
            for number, p in zip(saved["params"], params):
                by_id[id(p)] = number
        full: Dict[torch.Tensor, Dict[str, Any]] = {}
        scalars: Dict[str, Set[Any]] = {}
        for p in self.params:
            values = state_dict["state"].get(by_id[id(p)])
            if values is None:
                continue
            for key, value in values.items():
                if torch.is_tensor(value) and value.dim() > 0 and tuple(
                        value.shape) != tuple(p.shape):
                    raise ValueError(
                        f"load_state_dict: the state {key!r} of parameter {by_id[id(p)]}: "
                        f"expecting one value per element, shape {tuple(p.shape)}, got "
                        f"{tuple(value.shape)}; load a state_dict of this model")
                if not _elementwise(key, value, p.shape):
                    scalar = value.item() if torch.is_tensor(value) else value
                    if isinstance(scalar, (bool, int, float, str)):
                        scalars.setdefault(key, set()).add(scalar)
            full[p] = values
        summary: Dict[str, Any] = {"state_dict parameter groups": tuple(
            len(s["params"]) for s in saved_groups)}
        summary.update({f"state_dict {key}": tuple(sorted(v, key=repr))
                        for key, v in scalars.items()})
        return full, summary

    # -- the step --------------------------------------------------------------
    def keep_all(self) -> None:
        for p, buffer in zip(self.params, self.buffers):
            self.keep(p, buffer)

    @staticmethod
    def keep(param: torch.Tensor, buffer: torch.Tensor) -> None:
        """``param``'s gradient into its buffer, unless the parameter changed
        shape since it was wrapped (the step's agreement, or the check after
        its reduce-scatter, says so on every rank)."""
        if param.grad is None or param.grad.shape == buffer.shape:
            keep_grad_in(param, buffer)

    def param_shapes(self) -> Tuple[Tuple[int, ...], ...]:
        return tuple(tuple(p.shape) for p in self.params)

    def agreed(self) -> Dict[str, Any]:
        """What every rank's step must be alike in: the steps taken, and the
        parameters' shapes (one reshaped on one rank raises everywhere)."""
        return {**self.agreed_steps, "parameter shapes": self.param_shapes()}

    def check_shapes(self) -> None:
        """Every rank alike (their shapes agreed): the parameters still have
        the shapes they were wrapped with, which the pieces are cut from."""
        if self.param_shapes() != self.shapes:
            raise RuntimeError(
                f"ShardedOptimizer: the parameters were wrapped with the shapes "
                f"{self.shapes} and have {self.param_shapes()} now; the shards are cut from "
                "the shapes as wrapped: wrap the optimizer again")

    def gradient_ready(self, param: torch.Tensor) -> None:
        """Backward finished ``param``'s gradient: its bucket goes out once complete."""
        index = self.index[id(param)]
        if self.synchronized:
            return
        if index in self.marked:
            raise RuntimeError(
                "ShardedOptimizer: a second backward pass before step(): its gradients "
                "were already sent; wrap with overlap=False to accumulate several passes")
        if self.pending is None:
            self.pending = self.core.start_scatter(self.grads, self.agreed())
            self.keep_all()
        else:
            self.keep(param, self.buffers[index])
        self.marked.add(index)
        self.pending.ready(index)

    def synchronize(self) -> None:
        """This rank's shard of the gradients' mean becomes the gradients of
        its pieces (before clipping)."""
        if self.synchronized:
            return
        self.keep_all()
        pending, self.pending = self.pending, None
        self.marked.clear()
        if pending is None and not self.overlap:
            shards = self.core.scatter(self.grads, self.agreed())
        else:      # (a rank without a backward pass this step still calls alike)
            if pending is None:
                pending = self.core.start_scatter(self.grads, self.agreed())
            shards = pending.wait()
        self.check_shapes()
        for piece, grad in self.core.split(shards):
            self.tensor(piece).grad = torch_from_numpy(grad)
        if self.reducer.finite is False:
            # a value of the mean gradient is not finite, in some rank's
            # shard: every rank's shard says so, so that GradScaler (which
            # looks at this rank's shard alone) skips the step everywhere
            for tensor in self.tensors.values():
                assert tensor.grad is not None
                tensor.grad.fill_(float("inf"))
        self.synchronized = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        self.synchronize()
        grads = [numpy_from_torch(t.grad) for t in self.tensors.values() if t.grad is not None]
        if math.isinf(norm_type):
            local = max((float(np.max(np.abs(g))) for g in grads if g.size), default=0.0)
            total = self.reducer.allreduce(local, op="max")
        else:
            local = sum(float(np.sum(np.abs(g.astype(np.float64)) ** norm_type)) for g in grads)
            total = self.reducer.allreduce(local, op="sum") ** (1.0 / norm_type)
        factor = max_norm / (total + 1e-6)
        if factor < 1.0:
            with np.errstate(all="ignore"):      # inf * 0 is nan, as in torch's
                for g in grads:
                    g *= g.dtype.type(factor)
        return torch.tensor(total)

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state (its tensors)."""
        return sum(v.numel() * v.element_size() for state in self.optimizer.state.values()
                   for v in state.values() if torch.is_tensor(v))

    def step(self, closure: Optional[Callable[[], Any]],
             step: Callable[[Optional[Callable[[], Any]]], Any]) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.skip:
            self.synchronize()
        try:
            self.core.refresh()
            error = None
            try:
                step(None)
            except Exception as exc:     # raised on every rank, after the gather
                error = exc
            # each rank's shard into its parameters, the others' gathered (also
            # where a step failed: the ranks' parameters stay alike, each
            # shard as its step left it)
            self.core.gather()
            self.reducer.agree(error=error)
            self.steps += 1
        finally:
            self.synchronized = False
        return loss

    def zero_grad(self, set_to_none: bool) -> None:
        """Zero the parameters' gradients (either way: they keep their
        buffers) and drop the shard's."""
        if self.pending is not None and not self.synchronized:
            self.synchronize()             # finish what was started: every rank alike
        for p, buffer in zip(self.params, self.buffers):
            buffer.zero_()
            # (a parameter reshaped since it was wrapped gets no buffer: its
            # next step's agreement names the shapes)
            p.grad = buffer if p.shape == buffer.shape else None
        for tensor in self.tensors.values():
            tensor.grad = None
        self.synchronized = False


class _Sharded(Wrapped):
    """What a ShardedOptimizer adds to its optimizer's class."""

    mpigrad: _ShardedStep

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the reduced gradients so that their global norm is at most
        ``max_norm`` (torch.nn.utils.clip_grad_norm_ of the full mean
        gradient; one tiny allreduce of the shards' norms); return the norm
        before clipping. Synchronizes first."""
        return self.mpigrad.clip_grad_norm_(max_norm, norm_type)

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state (its tensors)."""
        return self.mpigrad.state_bytes()

    def state_dict(self) -> Dict[str, Any]:
        """torch's state_dict of the whole, unsharded optimizer (collective:
        every rank gets it; save it on one): it loads into this optimizer at
        any world size, and into the plain torch optimizer."""
        return self.mpigrad.state_dict(self.param_groups)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load torch's state_dict of the whole optimizer (``state_dict()``
        at any world size, or a plain torch optimizer's): this rank keeps its
        shard of it; the groups' options (lr, betas, ...) are restored. After
        RanksLost (``on_failure="shrink"``), this reshards over the survivors:
        load the last committed state_dict (mpigrad.elastic.State)."""
        self.mpigrad.load_state_dict(state_dict)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise NotImplementedError("ShardedOptimizer: add parameter groups to the torch "
                                  "optimizer before wrapping it")


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
    return wrap(optimizer, _Sharded, lambda wrapped: _ShardedStep(wrapped, overlap,
                                                                  reducer_options))

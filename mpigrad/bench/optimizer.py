"""The torch optimizer cases: a training step through ``DistributedOptimizer``
against the zero-copy reduce it should cost, after the same backward.

Both cases run the same synthetic backward over the layout's float32
parameters (autograd of ``sum(p.sum())``: each gradient accumulated in place,
one read-modify-write pass, and each parameter's hook fired as backward
finishes it) and the same SGD update. One steps through
``DistributedOptimizer`` (its hooks start the reduction during backward);
the other reduces the bucket views holding its gradients in place
(``Reducer.reduce(views, inplace=True)``) and steps a plain SGD. Their ratio
is what the optimizer adds to a zero-copy reduce.

With ``sharded``, two Adam steps after the same backward: through
``ShardedOptimizer`` (reduce-scatter, Adam on 1/p of the elements,
allgather) and through ``DistributedOptimizer`` (reduce, Adam on every
element): what sharding the state costs or saves in time.
"""

import importlib.util

import numpy as np

from ..reducer import Reducer

__all__ = ["optimizer_cases"]

_LR = 1e-6


def optimizer_cases(shapes, dtype, bucket_bytes, mean, sharded=False):
    """(cases, notes, free): the step cases (none where torch is not
    installed or the dtype is not float32), notes for the report, and a
    function that frees what they hold."""
    if importlib.util.find_spec("torch") is None:
        return {}, ["torch is not installed: the DistributedOptimizer cases are left out"], \
            lambda: None
    if np.dtype(dtype) != np.float32:
        return {}, [], lambda: None
    import torch

    from ..torch import DistributedOptimizer, ShardedOptimizer

    def parameters():
        return [torch.nn.Parameter(torch.full(tuple(s), 0.5)) for s in shapes]

    def backward(params):
        sum(p.sum() for p in params).backward()

    options = {"bucket_bytes": bucket_bytes, "mean": mean, "check_finite": True}
    wrapped = parameters()
    distributed = DistributedOptimizer(torch.optim.SGD(wrapped, lr=_LR), **options)
    plain = parameters()
    reducer = Reducer(**options)
    views = reducer.bucket_views([np.zeros(tuple(s), np.float32) for s in shapes])
    for p, view in zip(plain, views):
        p.grad = torch.from_numpy(view)
    sgd = torch.optim.SGD(plain, lr=_LR)

    def reduce_then_step():
        sgd.zero_grad(set_to_none=False)          # keeps the bucket views
        backward(plain)
        reducer.reduce(views, inplace=True)
        sgd.step()

    cases = {"torch DistributedOptimizer step": _stepping(distributed, wrapped, backward),
             "torch zero-copy reduce + SGD step": reduce_then_step}
    adams = []
    if sharded:
        for name, wrap in (("torch ShardedOptimizer Adam step", ShardedOptimizer),
                           ("torch DistributedOptimizer Adam step", DistributedOptimizer)):
            params = parameters()
            adams.append(wrap(torch.optim.Adam(params, lr=_LR), **options))
            cases[name] = _stepping(adams[-1], params, backward)

    def free():
        for opt in (distributed, *adams):
            opt.free()
        reducer.free()

    return cases, [], free


def _stepping(opt, params, backward):
    """A training step of ``opt`` over ``params`` after ``backward``."""
    def step():
        opt.zero_grad()
        backward(params)
        opt.step()
    return step

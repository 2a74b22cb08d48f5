"""mpigrad's faces in the benchmark: the same gradients through a face's own
call, timed beside the Reducer's (every face sums through the engine, so each
should run near ``reduce(inplace=True)``)."""

import importlib.util

import numpy as np

from .._base.dtypes import wire_dtype
from .verify import expected, fill

__all__ = ["face_cases"]


def face_cases(shapes, dtype, mean, size, rank):
    """(cases, references, notes): ``mpigrad.horovod.torch``'s grouped_allreduce of
    the layout (Average for a mean, as Horovod divides), where torch is installed,
    and ``mpigrad.jax.reduce`` inside ``jax.jit`` beside the same Reducer's reduce
    of the jax arrays outside it, where jax is; float32 layouts only."""
    if np.dtype(dtype) != np.float32:
        return {}, {}, []
    cases, references, notes = _jax_cases(shapes, mean, size, rank)
    if importlib.util.find_spec("torch") is None:
        return cases, references, notes + ["torch not installed: the Horovod face's "
                                           "case skipped"]
    import torch

    import mpigrad.horovod.torch as hvd
    hvd.init()
    tensors = [torch.ones(s) for s in shapes]
    op = hvd.Average if mean else hvd.Sum
    name = "mpigrad.horovod grouped_allreduce"
    want = expected(shapes, dtype, size, False)
    if mean:            # Horovod's average: the sum divided by the ranks, rounded once
        wire = wire_dtype(dtype)
        want = [(w.astype(wire) / wire.type(size)).astype(dtype) for w in want]
    cases[name] = lambda: hvd.grouped_allreduce(tensors, op=op)
    references[name] = (want, [t.numpy() for t in tensors])
    return cases, references, notes


def _jax_cases(shapes, mean, size, rank):
    """The jax face's cases: the layout's per-position values as jax arrays
    (jit parameters: XLA copies each into the call's in-place buffer, as
    ``Reducer.reduce`` outside jit copies the results out)."""
    if importlib.util.find_spec("jax") is None:
        return {}, {}, ["jax not installed: the jax face's cases skipped"]
    import jax

    import mpigrad.jax as mj
    from mpigrad import Reducer
    host = [np.empty(s, np.float32) for s in shapes]
    fill(host, rank)
    tree = [jax.numpy.asarray(h) for h in host]
    reducer = Reducer(mean=mean)
    in_jit = jax.jit(lambda t: mj.reduce(t, reducer))

    def inside():
        return jax.block_until_ready(in_jit(tree))

    def outside():
        return jax.block_until_ready(reducer.reduce(tree))
    want = expected(shapes, np.float32, size, mean)
    return ({"mpigrad.jax reduce in jit": inside, "mpigrad reduce of jax arrays": outside},
            {"mpigrad.jax reduce in jit": (want, []), "mpigrad reduce of jax arrays": (want, [])},
            [])

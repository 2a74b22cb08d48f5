"""mpigrad's faces in the benchmark: the same gradients through a face's own
call, timed beside the Reducer's (every face sums through the engine, so each
should run near ``reduce(inplace=True)``)."""

import importlib.util

import numpy as np

from .verify import expected, fill

__all__ = ["face_cases"]


def face_cases(shapes, dtype, mean, size, rank):
    """(cases, references, notes): ``mpigrad.horovod.torch``'s grouped_allreduce of
    the layout (Average for a mean), where torch is installed,
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
    want = expected(shapes, dtype, size, mean)       # (an average is the one mean)
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
    cases = {"mpigrad.jax reduce in jit": inside, "mpigrad reduce of jax arrays": outside}
    notes = []
    if importlib.util.find_spec("mpi4jax") is None:
        notes.append("mpi4jax not installed: its per-leaf allreduce in jit is not timed "
                     "(pip install mpi4jax)")
    else:
        cases["mpi4jax allreduce per leaf in jit"] = _mpi4jax_case(tree, mean, size)
    return cases, {name: (want, []) for name in cases}, notes


def _mpi4jax_case(tree, mean, size):
    """mpi4jax's allreduce of each leaf inside jax.jit (its documented use), the
    mean as mpigrad takes it (times 1/size in float32)."""
    import jax
    import mpi4jax
    from mpi4py import MPI
    scale = np.float32(1.0 / size) if mean else np.float32(1.0)

    @jax.jit
    def per_leaf(leaves):
        return [mpi4jax.allreduce(leaf, op=MPI.SUM, comm=MPI.COMM_WORLD) * scale
                for leaf in leaves]
    return lambda: jax.block_until_ready(per_leaf(tree))

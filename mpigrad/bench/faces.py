"""mpigrad's faces in the benchmark: the same gradients through a face's own
call, timed beside the Reducer's (every face sums through the engine, so each
should run near ``reduce(inplace=True)``)."""

import importlib.util

import numpy as np

from .._base.dtypes import wire_dtype
from .verify import expected

__all__ = ["face_cases"]


def face_cases(shapes, dtype, mean, size):
    """(cases, references, notes): ``mpigrad.horovod.torch``'s grouped_allreduce of
    the layout (Average for a mean, as Horovod divides), where torch is installed
    and the layout is float32."""
    if np.dtype(dtype) != np.float32:
        return {}, {}, []
    if importlib.util.find_spec("torch") is None:
        return {}, {}, ["torch not installed: the Horovod face's case skipped"]
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
    return ({name: lambda: hvd.grouped_allreduce(tensors, op=op)},
            {name: (want, [t.numpy() for t in tensors])}, [])

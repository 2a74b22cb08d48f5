"""Size sweeps: bucket cap, chunk size, tensor count and message size."""

import numpy as np
from mpi4py import MPI

from ..reducer import Reducer
from .timing import Progress, time_interleaved
from .verify import expected, fill, verify_cases

__all__ = ["SWEEPS", "run_sweep"]

_SIZES = [256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 64 << 20]


def _reducer_cases(comm, grads, **kwargs):
    """(reducer, its timed cases, a check returning the names of those whose
    results are wrong); every case returns its results."""
    reducer = Reducer(mean=False, **kwargs)
    views = reducer.bucket_views(grads)
    for v, g in zip(views, grads):
        v[...] = g
    cases = {"reduce inplace": lambda: reducer.reduce(grads, inplace=True),
             "zero-copy": lambda: reducer.reduce(views, inplace=True)}
    want = expected([g.shape for g in grads], grads[0].dtype, comm.size, mean=False)
    mine = dict(cases)      # the caller may add baselines to ``cases``

    def check():
        return verify_cases(comm, mine, lambda: [fill(a, comm.rank) for a in (grads, views)],
                            want)
    return reducer, cases, check


def _bucket_points(comm, grads, args):
    for size in _SIZES:
        yield (size, *_reducer_cases(comm, grads, bucket_bytes=size))


def _chunk_points(comm, grads, args):
    for size in _SIZES:
        yield (size, *_reducer_cases(comm, grads, chunk_bytes=size))


def _tensor_points(comm, grads, args, total_bytes=16 << 20):
    for count in (1, 4, 16, 64, 256, 1024, 4096):
        tensors = [np.ones(total_bytes // 4 // count, np.float32) for _ in range(count)]
        reducer, cases, check = _reducer_cases(comm, tensors)

        def loop(tensors=tensors):
            for t in tensors:
                comm.Allreduce(MPI.IN_PLACE, t, MPI.SUM)
        cases["per-tensor Allreduce"] = loop
        yield count, reducer, cases, check


def _message_points(comm, grads, args):
    for size in [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]:
        buf = np.ones(size // 4, np.float32)
        reducer, cases, check = _reducer_cases(comm, [buf.copy()])
        cases["single Allreduce"] = lambda buf=buf: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
        yield size, reducer, cases, check


SWEEPS = {"bucket": ("bucket_bytes", _bucket_points), "chunk": ("chunk_bytes", _chunk_points),
          "tensors": ("tensors (16 MiB in all)", _tensor_points),
          "message": ("message bytes", _message_points)}


def run_sweep(comm, grads, args):
    """Time every point of sweep ``args.sweep``, then verify its mpigrad cases.

    Returns (label, rows of (x, case, min s, median s), the "x case" names of
    the points whose results were wrong)."""
    label, points = SWEEPS[args.sweep]
    progress = Progress(comm, 8, f"sweep {args.sweep}")
    rows, failed = [], []
    for x, reducer, cases, check in points(comm, grads, args):
        timings = time_interleaved(comm, cases, args.repeats, warmup=1)
        rows += [(x, name, t.min, t.median) for name, t in timings.items()]
        failed += [f"{label} {x}: {name}" for name in check()]
        reducer.free()
        progress.step(f"{label} {x}")
    progress.close()
    return label, rows, failed

"""Size sweeps: bucket cap, chunk size, tensor count and message size."""

import sys
import time

import numpy as np
from mpi4py import MPI

from ..reducer import Reducer
from .timing import time_interleaved

__all__ = ["SWEEPS", "run_sweep"]

_SIZES = [256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 64 << 20]


class _Progress:
    """A progress line on stderr (rank 0) once a sweep runs longer than 3 s."""

    def __init__(self, comm, total, label):
        self.rank0, self.total, self.label = comm.rank == 0, total, label
        self.start, self.done = time.monotonic(), 0

    def step(self, what):
        self.done += 1
        elapsed = time.monotonic() - self.start
        if self.rank0 and elapsed > 3:
            sys.stderr.write(f"\r{self.label}: {self.done}/{self.total} ({what}), "
                             f"{elapsed:.0f} s   ")
            sys.stderr.flush()

    def close(self):
        if self.rank0 and time.monotonic() - self.start > 3:
            sys.stderr.write("\n")


def _reducer_cases(grads, **kwargs):
    reducer = Reducer(mean=False, **kwargs)
    views = reducer.bucket_views(grads)
    for v, g in zip(views, grads):
        v[...] = g
    return reducer, {"reduce inplace": lambda: reducer.reduce(grads, inplace=True),
                     "zero-copy": lambda: reducer.reduce(views, inplace=True)}


def _bucket_points(comm, grads, args):
    for size in _SIZES:
        reducer, cases = _reducer_cases(grads, bucket_bytes=size)
        yield size, cases, reducer


def _chunk_points(comm, grads, args):
    for size in _SIZES:
        reducer, cases = _reducer_cases(grads, chunk_bytes=size)
        yield size, cases, reducer


def _tensor_points(comm, grads, args, total_bytes=16 << 20):
    for count in (1, 4, 16, 64, 256, 1024, 4096):
        tensors = [np.ones(total_bytes // 4 // count, np.float32) for _ in range(count)]
        reducer, cases = _reducer_cases(tensors)

        def loop(tensors=tensors):
            for t in tensors:
                comm.Allreduce(MPI.IN_PLACE, t, MPI.SUM)
        cases["per-tensor Allreduce"] = loop
        yield count, cases, reducer


def _message_points(comm, grads, args):
    for size in [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]:
        buf = np.ones(size // 4, np.float32)
        reducer, cases = _reducer_cases([buf.copy()])
        cases["single Allreduce"] = lambda buf=buf: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
        yield size, cases, reducer


SWEEPS = {"bucket": ("bucket_bytes", _bucket_points), "chunk": ("chunk_bytes", _chunk_points),
          "tensors": ("tensors (16 MiB in all)", _tensor_points),
          "message": ("message bytes", _message_points)}


def run_sweep(comm, grads, args):
    """Time every point of sweep ``args.sweep``; rows of (x, case, min s, median s)."""
    label, points = SWEEPS[args.sweep]
    progress = _Progress(comm, 8, f"sweep {args.sweep}")
    rows = []
    for x, cases, reducer in points(comm, grads, args):
        timings = time_interleaved(comm, cases, args.repeats, warmup=1)
        rows += [(x, name, t.min, t.median) for name, t in timings.items()]
        reducer.free()
        progress.step(f"{label} {x}")
    progress.close()
    return label, rows

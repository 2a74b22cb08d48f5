"""Time ResNet-50's gradients as cupy arrays (staged through host memory)
against the same gradients as numpy arrays, and check the results against the
reduction computed from the rank count. Run: mpiexec -n 2 python -m mpi4py
scripts/gpu_staging.py (rank 0 prints; exits 1 on a wrong result)."""

import sys

import cupy
import numpy as np
from mpi4py import MPI

from mpigrad import Reducer
from mpigrad.bench.layouts import load_layout
from mpigrad.bench.timing import time_interleaved

comm = MPI.COMM_WORLD
cupy.cuda.Device(comm.rank % cupy.cuda.runtime.getDeviceCount()).use()
shapes = load_layout("resnet50")
host = [np.full(s, comm.rank + 1, np.float32) for s in shapes]
device = [cupy.asarray(h) for h in host]
reducer = Reducer()


def synced(fn):
    def run():
        out = fn()
        cupy.cuda.Device().synchronize()
        return out
    return run


cases = {
    "numpy reduce": lambda: reducer.reduce(host),
    "numpy inplace": lambda: reducer.reduce(host, inplace=True),
    "cupy reduce": synced(lambda: reducer.reduce(device)),
    "cupy inplace": synced(lambda: reducer.reduce(device, inplace=True)),
}
timings = time_interleaved(comm, cases, repeats=5, warmup=1)
mean = sum(range(1, comm.size + 1)) / comm.size
for g in device:
    g.fill(comm.rank + 1)
out = reducer.reduce(device)
ok = all(isinstance(o, cupy.ndarray) and o.device.id == g.device.id
         and bool((o == mean).all()) for o, g in zip(out, device))
ok = comm.allreduce(ok, op=MPI.LAND)
reducer.free()
if comm.rank == 0:
    for name, t in timings.items():
        print(f"{name:<16} min {t.min * 1e3:8.2f} ms  median {t.median * 1e3:8.2f} ms")
    print("cupy results on their device and equal to the mean of 1..p:", ok)
sys.exit(0 if ok else 1)

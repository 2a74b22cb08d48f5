"""Per-call overhead of hvd.allreduce (mpigrad's Horovod layer) on a small
tensor against a raw mpi4py Allreduce of the same buffer, and mpigrad's
own allreduce beside them; interleaved rounds of 200 calls, min and median
of the per-call times.

    mpiexec -n 2 python scripts/horovod_overhead.py [--elements 1024]
"""

import argparse
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import mpigrad
import mpigrad.horovod.torch as hvd


def per_call(fn, calls, comm):
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX) / calls


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--elements", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    hvd.init()
    comm = MPI.COMM_WORLD
    tensor = torch.ones(args.elements)
    buf = np.ones(args.elements, np.float32)
    out = np.empty_like(buf)
    cases = {"raw mpi4py Allreduce": lambda: comm.Allreduce(buf, out, op=MPI.SUM),
             "hvd.allreduce (Sum)": lambda: hvd.allreduce(tensor, op=hvd.Sum),
             "hvd.allreduce_ (Sum, in place)": lambda: hvd.allreduce_(tensor, op=hvd.Sum),
             "mpigrad.allreduce (sum)": lambda: mpigrad.allreduce(buf, op="sum")}
    times = {name: [] for name in cases}
    for name, fn in cases.items():
        per_call(fn, 20, comm)                   # warm up
    for _ in range(args.rounds):
        for name, fn in cases.items():
            times[name].append(per_call(fn, 200, comm))
    if comm.rank == 0:
        raw = min(times["raw mpi4py Allreduce"])
        print(f"{comm.size} ranks, {args.elements} float32 elements, per call:")
        for name, t in times.items():
            print(f"  {name}: min {min(t) * 1e6:.1f} us, median {statistics.median(t) * 1e6:.1f} us"
                  f" ({min(t) / raw:.2f}x raw)")


if __name__ == "__main__":
    main()

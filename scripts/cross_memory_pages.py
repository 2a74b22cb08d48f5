"""Cross-memory sums against the memory's pages: ResNet-50's gradients as 161
arrays (4 KiB pages under 4 MiB), the same as views of one allocation, four
and one large arrays (huge pages), and a memory copy of the same bytes;
interleaved, min of 10, the slowest rank's time.

    mpiexec -n 2 python scripts/cross_memory_pages.py
"""

import math
import time

import numpy as np
from mpi4py import MPI

import mpigrad
from mpigrad.bench.layouts import load_layout


def views_of_one_allocation(shapes, value):
    arena = np.full(sum(math.prod(s) for s in shapes), value, np.float32)
    views, offset = [], 0
    for shape in shapes:
        views.append(arena[offset:offset + math.prod(shape)].reshape(shape))
        offset += math.prod(shape)
    return views


def main():
    comm = MPI.COMM_WORLD
    shapes = load_layout("resnet50")
    n, value = sum(math.prod(s) for s in shapes), comm.rank + 1.0
    sets = {"161 arrays": [np.full(s, value, np.float32) for s in shapes],
            "161 views of one allocation": views_of_one_allocation(shapes, value),
            "4 arrays": [np.full(n // 4, value, np.float32) for _ in range(4)],
            "1 array": [np.full(n, value, np.float32)]}
    source, target = np.ones(n, np.float32), np.empty(n, np.float32)
    cases = {name: (lambda g=g: reducer.reduce(g, inplace=True)) for name, g in sets.items()}
    cases["memory copy"] = lambda: np.copyto(target, source)
    times = {name: [] for name in cases}
    with mpigrad.Reducer(cross_memory=True) as reducer:
        for _ in range(10):
            for name, case in cases.items():
                comm.Barrier()
                start = time.perf_counter()
                case()
                times[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    if comm.rank == 0:
        copy = min(times["memory copy"])
        for name, seconds in times.items():
            print(f"{name}: {min(seconds) * 1e3:.1f} ms ({min(seconds) / copy:.2f}x a copy)")


if __name__ == "__main__":
    main()

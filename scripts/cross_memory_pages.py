"""Cross-memory sums against the memory's pages: ResNet-50's gradients as 161
arrays (4 KiB pages under 4 MiB), the same as views of one allocation, four
and one large arrays (huge pages), and a memory copy of the same bytes;
interleaved (the bench's timing), min of 10.

    mpiexec -n 2 python scripts/cross_memory_pages.py
"""

import math

import numpy as np
from mpi4py import MPI

import mpigrad
from mpigrad.bench.layouts import load_layout
from mpigrad.bench.timing import time_interleaved


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
    with mpigrad.Reducer(cross_memory=True) as reducer:
        times = time_interleaved(comm, cases, repeats=10)
    if comm.rank == 0:
        copy = times["memory copy"].min
        for name, timing in times.items():
            print(f"{name}: {timing.min * 1e3:.1f} ms ({timing.min / copy:.2f}x a copy)")


if __name__ == "__main__":
    main()

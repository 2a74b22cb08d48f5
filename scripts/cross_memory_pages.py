"""Cross-memory sums against the memory's pages: ResNet-50's gradients as 161
arrays (4 KiB pages under 4 MiB), the same as views of one allocation, four
and one large arrays (huge pages), and a memory copy of the same bytes;
interleaved (the bench's timing), min of 10.

"bare transfer" cases move exactly the bytes an in-place sum moves between
the processes (each rank reads its slice of the peer's memory and writes it
back, in the backend's pieces) with no arithmetic: the floor of any node sum
through process_vm_readv/writev on that memory.

    mpiexec -n 2 python scripts/cross_memory_pages.py
"""

import math
import os

import numpy as np
from mpi4py import MPI

import mpigrad
from mpigrad._backends.cross_memory import Mover
from mpigrad.bench.layouts import load_layout
from mpigrad.bench.timing import time_interleaved

_PIECE = 1 << 18          # float32 elements: the backend's 1 MiB pieces


def views_of_one_allocation(shapes, value):
    arena = np.full(sum(math.prod(s) for s in shapes), value, np.float32)
    views, offset = [], 0
    for shape in shapes:
        views.append(arena[offset:offset + math.prod(shape)].reshape(shape))
        offset += math.prod(shape)
    return views


def bare_transfer(comm, arrays):
    """Each of 2 ranks reads its half of every peer array and writes it back."""
    mover, peer, piece = Mover(), 1 - comm.rank, np.empty(_PIECE, np.float32)
    pid = comm.allgather(os.getpid())[peer]
    table = comm.allgather([(a.ctypes.data, a.size) for a in arrays])[peer]

    def run():
        for address, size in table:
            lo, hi = size * comm.rank // 2, size * (comm.rank + 1) // 2
            for start in range(lo, hi, _PIECE):
                part = piece[:min(_PIECE, hi - start)]
                mover.read(pid, address + 4 * start, part)
                mover.write(pid, address + 4 * start, part)
        comm.Barrier()
    return run


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
    if comm.size == 2:
        for name in ("161 arrays", "1 array"):
            cases[f"{name}, bare transfer"] = bare_transfer(comm, sets[name])
    cases["memory copy"] = lambda: np.copyto(target, source)
    with mpigrad.Reducer(cross_memory=True) as reducer:
        times = time_interleaved(comm, cases, repeats=10)
    if comm.rank == 0:
        copy = times["memory copy"].min
        for name, timing in times.items():
            print(f"{name}: {timing.min * 1e3:.1f} ms ({timing.min / copy:.2f}x a copy)")


if __name__ == "__main__":
    main()

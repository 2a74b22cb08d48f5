"""A torch MLP trained with mpigrad.torch.DistributedOptimizer and Adam, then
the same with torch DDP on gloo, on the same data and seed.

    mpiexec -n 2 python examples/torch_mlp.py

Both are data-parallel over the MPI ranks (DDP's process group is set up from
MPI's ranks, on 127.0.0.1). The example checks that both end with the same
weights within TOLERANCE, and that mpigrad's are bitwise identical on every
rank, and prints the time per step of both side by side. It exits non-zero
when a claim fails.
"""

import gc
import socket
import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpigrad.torch as mgt

STEPS, BATCH_PER_RANK, LR = 30, 64, 1e-3
TOLERANCE = 1e-4          # float32 sums in another order, through Adam's normalisation


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def batches(rank, size):
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(BATCH_PER_RANK * size, 32, generator=g)
        y = torch.randint(0, 10, (BATCH_PER_RANK * size,), generator=g)
        yield x[rank::size], y[rank::size]


def train(model, optimizer, rank, size):
    times = []
    for x, y in batches(rank, size):
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]                # median seconds per step


def main():
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    mine = make_model()
    opt = mgt.DistributedOptimizer(torch.optim.Adam(mine.parameters(), lr=LR))
    mgt.broadcast_parameters(mine.state_dict(), root=0)
    t_mpigrad = comm.allreduce(train(mine, opt, comm.rank, comm.size), op=MPI.MAX)
    opt.free()

    port = comm.bcast(_free_port() if comm.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.rank, world_size=comm.size)
    ddp = torch.nn.parallel.DistributedDataParallel(make_model())
    t_ddp = comm.allreduce(train(ddp, torch.optim.Adam(ddp.parameters(), lr=LR),
                                 comm.rank, comm.size), op=MPI.MAX)
    theirs = ddp.module
    # DDP before its group: a gloo group whose last owner is DDP's reducer is destroyed
    # holding the GIL, which gloo's worker thread may be waiting for (torch issue 56297:
    # the process then never exits); destroy_process_group releases it first
    del ddp
    gc.collect()
    dist.destroy_process_group()

    with torch.no_grad():
        deviation = max(float((a - b).abs().max()) for a, b in
                        zip(mine.parameters(), theirs.parameters()))
    blobs = [p.detach().numpy().tobytes() for p in mine.parameters()]
    identical = comm.allreduce(blobs == comm.bcast(blobs), MPI.LAND)
    ok = comm.allreduce(deviation <= TOLERANCE, MPI.LAND) and identical
    if comm.rank == 0:
        print(f"time per step: mpigrad {t_mpigrad * 1e3:.2f} ms, DDP on gloo "
              f"{t_ddp * 1e3:.2f} ms ({comm.size} ranks, median of {STEPS})")
        print(f"max weight difference mpigrad vs DDP {deviation:.1e} (tolerance "
              f"{TOLERANCE:g}); identical on all ranks: {identical}")
        print("claims hold:", ok)
    return 0 if ok else 1


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())

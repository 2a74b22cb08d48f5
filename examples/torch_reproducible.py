"""The same bits at any rank count: a torch model trained with gradient
accumulation, each micro-batch's gradients added to an mpigrad.ExactSum and
reduced by a Reducer(reproducible=True).

    mpiexec -n 2 python examples/torch_reproducible.py

Every step's global batch is 8 micro-batches, split over the ranks (8 on one
rank, 4 each on two, ...). The reducer returns the correctly rounded mean of
every micro-batch's gradients, whatever the split, so the run ends with
parameters bitwise equal to the same training on one rank, which every rank
also runs here (on its own, over MPI.COMM_SELF) to check the claim: "DP=1 is
DP>1", bit for bit. With the default Reducer the mean is rounded in an order
that depends on the rank count, and the runs drift apart by rounding.
"""

import sys

import numpy as np
import torch
from mpi4py import MPI

import mpigrad

STEPS, MICRO_BATCHES, MICRO_BATCH, LR = 30, 8, 16, 0.05
torch.set_num_threads(1)          # the same kernels' bits in every process


def batches():
    """Every step's micro-batches (the same on every rank)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((STEPS, MICRO_BATCHES, MICRO_BATCH, 8)).astype(np.float32)
    y = np.sin(x.sum(axis=3, keepdims=True)).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(y)


def train(comm):
    """Train over ``comm``: rank r takes micro-batches r, r + size, ..."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = batches()
    mine = range(comm.rank, MICRO_BATCHES, comm.size)
    with mpigrad.Reducer(comm, reproducible=True, degree=MICRO_BATCHES) as reducer:
        for step in range(STEPS):
            acc = mpigrad.ExactSum()
            for m in mine:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x[step, m]), y[step, m]).backward()
                acc.add([p.grad for p in model.parameters()])
            if acc.count == 0:                 # more ranks than micro-batches: add nothing
                acc.add([torch.zeros_like(p) for p in model.parameters()])
            for p, grad in zip(model.parameters(), reducer.reduce(acc)):
                p.grad = grad                  # the mean over the 8 micro-batches
            opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def main():
    comm = MPI.COMM_WORLD
    split = train(comm)
    alone = train(MPI.COMM_SELF)
    same = all(np.array_equal(a.view(np.uint32), b.view(np.uint32))
               for a, b in zip(split, alone))
    every = comm.allgather([a.tobytes() for a in split])
    identical = all(blobs == every[0] for blobs in every)
    agreed = comm.allreduce(same and identical, op=MPI.LAND)
    if comm.rank == 0:
        print(f"{comm.size} ranks, {MICRO_BATCHES} micro-batches split over them: parameters "
              f"bitwise equal to 1 rank's: {same}; identical on every rank: {identical}")
        print(f"claims hold: {agreed}")
    sys.exit(0 if agreed else 1)


if __name__ == "__main__":
    main()

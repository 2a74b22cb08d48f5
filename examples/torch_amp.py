"""Mixed precision with GradScaler and mpigrad.torch.DistributedOptimizer:
reduce first (synchronize), then unscale_ and clip, then step without reducing
again (skip_synchronize).

    mpiexec -n 2 python examples/torch_amp.py

One rank's loss is made inf at step INF_STEP. Because the gradients are
reduced before GradScaler looks at them, every rank sees the inf and skips
that step together; the example checks that, and that the parameters stay
bitwise identical on every rank, and exits non-zero otherwise.
"""

import sys

import torch
from mpi4py import MPI

import mpigrad.torch as mgt

STEPS, INF_STEP = 8, 3


def main():
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = mgt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    g = torch.Generator().manual_seed(comm.rank)
    skipped = []
    for step in range(STEPS):
        x = torch.randn(32, 16, generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        if step == INF_STEP and comm.rank == comm.size - 1:
            loss = loss * float("inf")                    # this rank overflows
        scaler.scale(loss.float()).backward()
        opt.synchronize()                                 # reduce before looking at the grads
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        before = [p.detach().clone() for p in model.parameters()]
        with opt.skip_synchronize():
            scaler.step(opt)                              # skipped when opt's grads have inf
        scaler.update()
        skipped.append(all(torch.equal(a, b) for a, b in zip(model.parameters(), before)))
    everyone = comm.allgather(skipped)
    blobs = [p.detach().numpy().tobytes() for p in model.parameters()]
    identical = comm.allreduce(blobs == comm.bcast(blobs), MPI.LAND)
    together = all(s == everyone[0] for s in everyone)
    ok = together and identical and everyone[0][INF_STEP] and sum(everyone[0]) == 1
    if comm.rank == 0:
        steps = [i for i, s in enumerate(everyone[0]) if s]
        print(f"steps skipped: {steps} on every rank: {together} (inf injected at step "
              f"{INF_STEP} on rank {comm.size - 1}); parameters identical on all ranks: "
              f"{identical}; agreed finite flag after the last step: {opt.finite}")
        print("claims hold:", ok)
    opt.free()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

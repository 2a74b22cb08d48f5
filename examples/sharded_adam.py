"""Sharded Adam (ZeRO-2) on torch: each rank keeps the Adam state of its
shard of the parameters only, and trains as one rank with the whole batch.

    mpiexec -n 2 python examples/sharded_adam.py

mpigrad.torch.ShardedOptimizer wraps torch's own Adam: a step reduce-scatters
the gradients (the mean gradient is never made whole), steps Adam on this
rank's shard, and gathers the updated parameters. The example prints the
Adam state bytes per rank against an unsharded torch Adam, and the largest
deviation from 1-rank full-batch training; it saves a checkpoint (torch's
format, whole) and checks that a plain Adam resumes from it. It exits
non-zero if the state is not 1/p of it (give or take a few elements) or a
deviation is beyond float32 rounding.
"""

import sys

import torch
from mpi4py import MPI

import mpigrad.torch as mgt

STEPS, BATCH_PER_RANK, LR = 30, 32, 0.01
TOLERANCE = 1e-5          # float32 sums in another order


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def data(size):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(STEPS, BATCH_PER_RANK * size, 8, generator=g)
    return x, torch.sin(x).sum(dim=2, keepdim=True)


def train(net, opt, x, y, steps):
    for k in steps:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[k]), y[k]).backward()
        opt.step()


def state_bytes(opt):
    return sum(v.numel() * v.element_size() for s in opt.state.values()
               for key, v in s.items() if torch.is_tensor(v) and key != "step")


def deviation(a, b):
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def main():
    comm = MPI.COMM_WORLD
    x, y = data(comm.size)
    net = model()
    opt = mgt.ShardedOptimizer(torch.optim.Adam(net.parameters(), lr=LR))
    mgt.broadcast_parameters(net.state_dict(), root=0)
    mine = slice(comm.rank, None, comm.size)
    train(net, opt, x[:, mine], y[:, mine], range(STEPS // 2))
    checkpoint = opt.state_dict()      # collective: the whole optimizer (torch.save it on one rank)
    train(net, opt, x[:, mine], y[:, mine], range(STEPS // 2, STEPS))
    sharded_bytes = state_bytes(opt)
    opt.free()

    reference = model()                        # 1 rank, whole batch, unsharded
    ref_opt = torch.optim.Adam(reference.parameters(), lr=LR)
    train(reference, ref_opt, x, y, range(STEPS // 2))
    resumed = model()                          # a plain Adam from the checkpoint
    resumed.load_state_dict(reference.state_dict())
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=LR)
    resumed_opt.load_state_dict(checkpoint)
    train(reference, ref_opt, x, y, range(STEPS // 2, STEPS))
    train(resumed, resumed_opt, x, y, range(STEPS // 2, STEPS))
    full_bytes = state_bytes(ref_opt)
    trained, resumed_off = deviation(net, reference), deviation(resumed, reference)
    state_ok = sharded_bytes <= full_bytes / comm.size + 64
    ok = comm.allreduce(trained <= TOLERANCE and resumed_off <= TOLERANCE and state_ok,
                        MPI.LAND)
    if comm.rank == 0:
        print(f"Adam state per rank: {sharded_bytes} bytes sharded against {full_bytes} "
              f"unsharded ({sharded_bytes / full_bytes:.3f}; 1/p = {1 / comm.size:.3f})")
        print(f"{comm.size} ranks x batch {BATCH_PER_RANK} against 1 rank x batch "
              f"{BATCH_PER_RANK * comm.size}: largest parameter deviation {trained:.2e} "
              f"(tolerance {TOLERANCE:g})")
        print(f"a plain torch Adam resumed from the sharded checkpoint: largest deviation "
              f"{resumed_off:.2e}")
        print(f"claims hold: {ok}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

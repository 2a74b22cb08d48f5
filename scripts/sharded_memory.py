"""Adam state bytes and peak RSS per rank: torch Adam through
ShardedOptimizer against DistributedOptimizer, on a layout's float32
parameter shapes, after 3 steps (each mode in its own job: peak RSS is a
process's).

    mpiexec -n 2 python scripts/sharded_memory.py --layout resnet50 --mode sharded
    mpiexec -n 2 python scripts/sharded_memory.py --layout resnet50 --mode distributed
"""

import argparse
import math
import resource

import torch
from mpi4py import MPI

import mpigrad.torch as mgt
from mpigrad.bench.layouts import load_layout


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="resnet50")
    parser.add_argument("--mode", choices=["sharded", "distributed"], default="sharded")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    shapes = load_layout(args.layout)
    params = [torch.nn.Parameter(torch.full(tuple(s), 0.5)) for s in shapes]
    wrap = mgt.ShardedOptimizer if args.mode == "sharded" else mgt.DistributedOptimizer
    opt = wrap(torch.optim.Adam(params, lr=1e-6))
    for _ in range(3):
        opt.zero_grad()
        sum(p.sum() for p in params).backward()
        opt.step()
    state = sum(v.numel() * v.element_size() for s in opt.state.values()
                for k, v in s.items() if torch.is_tensor(v) and k != "step")
    full = 2 * 4 * sum(math.prod(s) for s in shapes)          # exp_avg, exp_avg_sq
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    states, rsses = comm.gather(state), comm.gather(rss)
    if comm.rank == 0:
        print(f"{args.layout} {args.mode} at {comm.size} ranks: Adam state per rank "
              f"{max(states) / 2**20:.1f} MiB (max over ranks) against {full / 2**20:.1f} MiB "
              f"unsharded ({max(states) / full:.4f}; 1/p = {1 / comm.size:.4f}); "
              f"peak RSS per rank {max(rsses):.0f} MiB")
    opt.free()


if __name__ == "__main__":
    main()

"""A Horovod-style synthetic benchmark on mpigrad (``import
mpigrad.horovod.torch as hvd``), and torch DDP on gloo with the same model,
data and steps in the same run: images per second of each.

    mpiexec -n 2 python examples/horovod/synthetic_benchmark.py [--batch 32]

The model is a small ResNet-style CNN (no torchvision needed) on random
3x64x64 images. Each measurement is ``--iters`` batches after ``--warmup``;
the two runs alternate ``--rounds`` times and the best round of each is
reported. It exits non-zero only if the trained parameters differ across
ranks (timings are reported, never asserted).
"""

import argparse
import gc
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mpigrad.horovod.torch as hvd


class Block(torch.nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.a = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.b = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.na, self.nb = torch.nn.BatchNorm2d(channels), torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(x + self.nb(self.b(F.relu(self.na(self.a(x))))))


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2, padding=1), torch.nn.ReLU(), Block(32),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(), Block(64), Block(64),
        torch.nn.Conv2d(64, 128, 3, stride=2, padding=1), torch.nn.ReLU(), Block(128),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(128, 1000))


def images_per_second(net, opt, data, target, iters, warmup):
    def step():
        opt.zero_grad()
        F.cross_entropy(net(data), target).backward()
        opt.step()
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return data.shape[0] * iters / (time.perf_counter() - start)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    data = torch.randn(args.batch, 3, 64, 64, generator=torch.Generator().manual_seed(hvd.rank()))
    target = torch.randint(0, 1000, (args.batch,), generator=torch.Generator().manual_seed(7))

    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    port = hvd.broadcast_object(free_port() if hvd.rank() == 0 else None, root_rank=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=hvd.rank(), world_size=hvd.size())
    ddp_net = torch.nn.parallel.DistributedDataParallel(model())
    ddp_opt = torch.optim.SGD(ddp_net.parameters(), lr=0.01, momentum=0.9)

    mine, theirs = [], []
    for _ in range(args.rounds):                 # alternate: the machine's state drifts
        mine.append(images_per_second(net, opt, data, target, args.iters, args.warmup))
        theirs.append(images_per_second(ddp_net, ddp_opt, data, target, args.iters,
                                        args.warmup))
    # DDP before its group: a gloo group whose last owner is DDP's reducer is destroyed
    # holding the GIL, which gloo's worker thread may be waiting for (torch issue 56297)
    del ddp_net, ddp_opt
    gc.collect()
    dist.destroy_process_group()
    # the slowest rank sets the pace
    best_mine = min(hvd.allgather_object(max(mine)))
    best_theirs = min(hvd.allgather_object(max(theirs)))
    blobs = hvd.allgather_object([p.detach().numpy().tobytes() for p in net.parameters()])
    identical = all(b == blobs[0] for b in blobs)
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, batch {args.batch} per rank: mpigrad (hvd API) "
              f"{best_mine:.1f} img/s per rank ({best_mine * hvd.size():.1f} in total), "
              f"torch DDP on gloo {best_theirs:.1f} img/s per rank; "
              f"mpigrad / DDP {best_mine / best_theirs:.3f} (best of {args.rounds} rounds)")
        print(f"parameters identical on every rank: {identical}")
        print(f"claims hold: {identical}")
    opt.free()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

"""DDP on the torch.distributed backend "mpigrad" behind a backward of native compute:
ResNet-50's parameters, each gradient's backward a numpy busy loop (which releases the GIL,
as torch's kernels do) of its share of 300 ms; the time of a DDP backward against the same
backward without DDP (their difference: the exposed communication). Across 2 nodes:

    python -m mpigrad.bench.cluster --nodes 2 --ppn 2 --link 2gbit -- \
        python scripts/ddp_overlap.py
"""
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
import mpigrad.torch  # noqa: F401  (registers the "mpigrad" backend)
from mpigrad.bench.layouts import load_layout

comm = MPI.COMM_WORLD
torch.set_num_threads(1)
dist.init_process_group("mpigrad")
shapes = load_layout("resnet50")
total = sum(int(np.prod(s)) for s in shapes)
B = 0.3
_w = np.ones(1 << 14, np.float32)
class Spin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds; return x.clone()
    @staticmethod
    def backward(ctx, g):
        end = time.perf_counter() + ctx.seconds
        while time.perf_counter() < end: np.sqrt(_w, out=_w)
        return g, None
class Layout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(s)) for s in shapes)
    def forward(self):
        return sum(Spin.apply(p, B * p.numel() / total).sum() for p in self.params)
plain, ddp = Layout(), torch.nn.parallel.DistributedDataParallel(Layout())
def step(m):
    m.zero_grad(set_to_none=True); m().backward()
res = {}
for rep in range(4):
    for name, m in (("plain", plain), ("ddp", ddp)):
        comm.Barrier(); t = time.perf_counter(); step(m); comm.Barrier()
        if rep: res.setdefault(name, []).append(time.perf_counter() - t)
if comm.rank == 0:
    times = {k: min(v) * 1e3 for k, v in res.items()}
    print(f"backward {times['plain']:.0f} ms, DDP backward {times['ddp']:.0f} ms: "
          f"{times['ddp'] - times['plain']:.0f} ms exposed", flush=True)
dist.destroy_process_group()

"""Baselines from other libraries, measured in the same run when installed:
torch.distributed on gloo (flat all_reduce, DistributedDataParallel, 1 KiB
calls) beside the same on mpigrad's backend, and Horovod."""

import importlib.util
import os
import socket
import time

import numpy as np

__all__ = ["peer_cases", "SMALL_CALLS", "fsdp2_stack", "fsdp2_step"]

#: the 1 KiB all_reduce calls of one timed round (gloo and the mpigrad backend)
SMALL_CALLS = 100


def _torch_cases(comm, shapes, flat_elements):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if not dist.is_initialized():
        # on a cluster of namespaces rank 0's hostname names its side of the link; on one
        # machine gloo stays on loopback
        host = socket.gethostname() if os.environ.get("MPIGRAD_CLUSTER_HOSTS") else "127.0.0.1"
        host, port = comm.bcast((host, _free_port(host)) if comm.rank == 0 else None)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}",
                                rank=comm.rank, world_size=comm.size)
    import mpigrad.torch  # noqa: F401  (registers the "mpigrad" backend)
    torch.set_num_threads(1)
    mine = dist.new_group(backend="mpigrad")
    flat = torch.ones(flat_elements, dtype=torch.float32)
    small = torch.ones(256, dtype=torch.float32)            # 1 KiB

    class Layout(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(s))
                                                 for s in shapes)

        def forward(self):
            return sum((p * 1.0).sum() for p in self.params)

    model = Layout()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp_mine = torch.nn.parallel.DistributedDataParallel(Layout(), process_group=mine)
    ddp_bf16 = torch.nn.parallel.DistributedDataParallel(Layout())
    # torch refuses bf16_compress_hook by its name without NCCL; the same function under
    # another name runs on gloo (which sums bfloat16)
    ddp_bf16.register_comm_hook(None, lambda state, bucket:
                                default_hooks.bf16_compress_hook(state, bucket))

    def step(module):
        module.zero_grad(set_to_none=True)
        module().backward()

    def calls(group):
        for _ in range(SMALL_CALLS):
            dist.all_reduce(small, group=group)

    share = torch.empty(flat_elements // comm.size, dtype=torch.float32)
    whole = flat[:share.numel() * comm.size]
    # torch 2.13 renamed reduce_scatter_tensor (a deprecation warning per call)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return {
        "gloo all_reduce (flat)": lambda: dist.all_reduce(flat),
        "mpigrad backend all_reduce (flat)": lambda: dist.all_reduce(flat, group=mine),
        "gloo reduce_scatter_tensor (flat)": lambda: reduce_scatter(share, whole),
        "mpigrad backend reduce_scatter_tensor (flat)":
            lambda: reduce_scatter(share, whole, group=mine),
        "gloo FSDP2 step (stack)": fsdp2_step(fsdp2_stack(), None),
        "mpigrad backend FSDP2 step (stack)": fsdp2_step(fsdp2_stack(), mine),
        "gloo FSDP2 step (layout)": fsdp2_step(Layout(), None),
        "mpigrad backend FSDP2 step (layout)": fsdp2_step(Layout(), mine),
        "torch backward (no DDP)": lambda: step(model),
        "torch DDP backward": lambda: step(ddp),
        "torch DDP backward, mpigrad backend": lambda: step(ddp_mine),
        "torch DDP backward, bf16_compress_hook": lambda: step(ddp_bf16),
        f"gloo all_reduce 1 KiB x {SMALL_CALLS}": lambda: calls(None),
        f"mpigrad backend all_reduce 1 KiB x {SMALL_CALLS}": lambda: calls(mine),
    }


#: the communication-heavy FSDP2 stack: 8 Linear(2048, 2048) layers, a batch of 4
STACK = (8, 2048, 4)


def fsdp2_stack():
    import torch
    torch.manual_seed(0)
    layers, width, _ = STACK
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def fsdp2_step(model, group):
    """One FSDP2 training step (forward and backward: an all-gather and a
    reduce-scatter per sharded module) of ``model`` ``fully_shard``ed over
    ``group`` (None: the default, gloo): a stack's every layer and the whole,
    a layout's parameters as one."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
    takes_input = isinstance(model, torch.nn.Sequential)
    for layer in model if takes_input else ():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batch = torch.randn(STACK[2], STACK[1]) if takes_input else None

    def step():
        model.zero_grad(set_to_none=True)
        (model(batch) if takes_input else model()).sum().backward()
    return step


def _free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _horovod_cases(shapes):
    import horovod.torch as hvd
    import torch
    hvd.init()
    tensors = [torch.ones(s) for s in shapes]

    def per_tensor_async():
        handles = [hvd.allreduce_async_(t, op=hvd.Sum) for t in tensors]
        for h in handles:
            hvd.synchronize(h)

    return {"horovod grouped_allreduce": lambda: hvd.grouped_allreduce(tensors, op=hvd.Sum),
            "horovod allreduce_async_": per_tensor_async}


def peer_cases(comm, shapes, dtype):
    """(cases, notes): the peers' cases for float32 layouts, and why any is missing."""
    cases, notes = {}, []
    if np.dtype(dtype) != np.float32:
        return cases, ["torch and Horovod baselines run for float32 layouts only"]
    elements = sum(int(np.prod(s)) for s in shapes)
    if importlib.util.find_spec("torch") is None:
        notes.append("torch not installed: gloo and DDP baselines skipped "
                     "(pip install torch)")
    else:
        start = time.perf_counter()
        cases.update(_torch_cases(comm, shapes, elements))
        notes.append(f"torch gloo set up in {time.perf_counter() - start:.1f} s; "
                     "DDP exposed communication = 'torch DDP backward' - "
                     "'torch backward (no DDP)'")
    if importlib.util.find_spec("horovod") is None:
        notes.append("Horovod is not installed, so its baselines were skipped (they need "
                     "Horovod built with its torch extension: its 0.28.1 release on PyPI does "
                     "not compile against torch 2.1 or later, its main branch, built from "
                     "source, does)")
    else:
        cases.update(_horovod_cases(shapes))
    return cases, notes

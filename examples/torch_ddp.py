"""torch DDP and FSDP2 on the mpigrad backend: a gloo script whose only
change is the backend's name in init_process_group (and `import mpigrad.torch`).

    mpiexec -n 2 python examples/torch_ddp.py          # DDP, DDP with a hook, FSDP2
    mpiexec -n 2 python examples/torch_ddp.py --only fsdp2
    mpiexec -n 2 python examples/torch_ddp.py --compile   # torch.compile of DDP, FSDP2

DDP plain; DDP with fp16_compress_hook; FSDP2's fully_shard on a CPU mesh.

(torch refuses bf16_compress_hook off CUDA/XPU, whatever the backend; the fp16
hook's half-precision buckets are summed in float32 by mpigrad.)

No MASTER_ADDR, MASTER_PORT or store: ranks come from MPI. Each is then
trained again on gloo in the same processes, and the script checks its
claim: the loss curves agree within 1e-6 and the parameters are bitwise
equal on every rank.
"""

import argparse
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpigrad.torch  # noqa: F401  (registers the "mpigrad" backend)

STEPS, TOLERANCE = 8, 1e-6


def wrap(model, how):
    """The model under DDP (with the fp16 hook), or sharded by FSDP2."""
    if how == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if how == "hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return ddp


def full(param):
    """A parameter's whole value (FSDP2's are sharded DTensors)."""
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()


def train(how, compiled):
    """The loss of every step of a small MLP, on this rank's data (its forward
    through torch.compile if ``compiled``), and the parameters at the end."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    if compiled:      # a buffer: DDP broadcasts it in forward, inside the compiled code
        model.register_buffer("seen", torch.zeros(1))
    wrapped = wrap(model, how)
    forward = torch.compile(wrapped) if compiled else wrapped
    opt = torch.optim.Adam(wrapped.parameters(), lr=0.01) if how == "fsdp2" else \
        torch.optim.SGD(wrapped.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64 * size, 16, generator=g), torch.randn(64 * size, 1, generator=g)
    x, y = x[rank::size], y[rank::size]
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(forward(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [full(p) for p in wrapped.parameters()]


def on(backend, comm, how, compiled):
    """``train(how, compiled)`` in a process group of ``backend``: mpigrad's from MPI
    alone, gloo's over a file store in a directory of rank 0's (its path sent over
    MPI: no port to pick, so parallel runs cannot collide)."""
    if backend == "mpigrad":
        dist.init_process_group("mpigrad")          # the one change from a gloo script
        try:
            return train(how, compiled)
        finally:
            dist.destroy_process_group()
    folder = comm.bcast(tempfile.mkdtemp(prefix="torch-ddp-") if comm.rank == 0 else None)
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store",
                                rank=comm.rank, world_size=comm.size)
        try:
            return train(how, compiled)
        finally:
            dist.destroy_process_group()
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


LABELS = {"ddp": "DDP", "hook": "DDP with fp16_compress_hook", "fsdp2": "FSDP2"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(LABELS),
                        help="run one of them (default: each in turn)")
    parser.add_argument("--compile", action="store_true",
                        help="the forward through torch.compile (default: DDP and FSDP2)")
    args = parser.parse_args()
    comm, ok = MPI.COMM_WORLD, True
    hows = [args.only] if args.only else ["ddp", "fsdp2"] if args.compile else list(LABELS)
    for how in hows:
        mine, params = on("mpigrad", comm, how, args.compile)
        theirs, _ = on("gloo", comm, how, args.compile)
        deviation = max(abs(a - b) for a, b in zip(mine, theirs))
        blobs = [p.numpy().tobytes() for p in params]
        identical = comm.allreduce(blobs == comm.bcast(blobs), MPI.LAND)
        ok = comm.allreduce(deviation <= TOLERANCE, MPI.LAND) and identical and ok
        if comm.rank == 0:
            label = f"torch.compile of {LABELS[how]}" if args.compile else LABELS[how]
            print(f"{comm.size} ranks, {label}: mpigrad's loss curve against gloo's: "
                  f"largest difference {deviation:.2e} (tolerance {TOLERANCE:g}); parameters "
                  f"identical on every rank: {identical}; gloo's losses {theirs}")
    if comm.rank == 0:
        print(f"claims hold: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

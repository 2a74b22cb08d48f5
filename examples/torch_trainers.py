"""Lightning Fabric and Hugging Face Accelerate on the mpigrad backend,
launched by mpiexec, unchanged but for the backend's name.

    mpiexec -n 2 python examples/torch_trainers.py --trainer lightning
    mpiexec -n 2 python examples/torch_trainers.py --trainer accelerate
    mpiexec -n 2 python examples/torch_trainers.py --trainer lightning --backend gloo

Lightning: DDPStrategy(process_group_backend="mpigrad") with Lightning's
MPIEnvironment (which sets a rendezvous address: torch then opens its store).
Accelerate: the process group is made first, init_process_group("mpigrad")
with no address at all, then Accelerator(cpu=True) takes it (Accelerate's
InitProcessGroupKwargs accepts only "gloo" or "mpi" on CPU). Prints the loss
of every step (rank 0) and checks that the parameters are bitwise equal on
every rank; tests/test_examples.py compares the loss curve with torch_ddp.py's
DDP on gloo (the same model, data and steps), within 1e-6.
"""

import argparse
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpigrad.torch  # noqa: F401  (registers the "mpigrad" backend)

STEPS = 8


def lightning(backend, world):
    """(model, optimizer, backward) set up by Lightning Fabric."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.environments import MPIEnvironment
    from lightning.fabric.strategies import DDPStrategy
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    per_node = node.Get_size()
    node.Free()
    fabric = Fabric(accelerator="cpu", devices=per_node, num_nodes=world.size // per_node,
                    strategy=DDPStrategy(process_group_backend=backend,
                                         cluster_environment=MPIEnvironment()))
    fabric.launch()
    model, opt = fabric.setup(*model_and_optimizer())
    return model, opt, fabric.backward


def accelerate(backend, world):
    """(model, optimizer, backward) set up by Accelerate, on a process group
    made first (gloo's over a TCP store on rank 0's loopback)."""
    from accelerate import Accelerator
    if backend == "gloo":
        port = None
        if world.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(world.bcast(port)))
    dist.init_process_group(backend, rank=world.rank, world_size=world.size)
    with warnings.catch_warnings():       # Accelerate's note on OMP_NUM_THREADS
        warnings.simplefilter("ignore", UserWarning)
        accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(*model_and_optimizer())
    return model, opt, accelerator.backward


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", required=True, choices=("lightning", "accelerate"))
    parser.add_argument("--backend", default="mpigrad", choices=("mpigrad", "gloo"))
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    setup = {"lightning": lightning, "accelerate": accelerate}[args.trainer]
    model, opt, backward = setup(args.backend, world)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64 * world.size, 16, generator=g), torch.randn(64 * world.size, 1, generator=g)
    x, y = x[world.rank::world.size], y[world.rank::world.size]
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        backward(loss)
        opt.step()
        losses.append(loss.item())
    blobs = [p.detach().numpy().tobytes() for p in model.parameters()]
    identical = world.allreduce(blobs == world.bcast(blobs), MPI.LAND)
    if world.rank == 0:
        print(f"{world.size} ranks, {args.trainer} on {dist.get_backend()}: losses {losses}")
        print(f"parameters identical on every rank: {identical}")
        print(f"claims hold: {identical}")
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

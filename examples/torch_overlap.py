"""A torch trainer whose gradients are reduced while backward runs.

    mpiexec -n 2 python -m mpi4py examples/torch_overlap.py

Each parameter's post-accumulate-grad hook marks its gradient ready, so a
bucket is reduced as soon as backward has produced all of its gradients.
"""

import torch
from mpi4py import MPI

import mpigrad


def main(steps=50):
    comm = MPI.COMM_WORLD
    torch.manual_seed(comm.rank)                       # different data per rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    params = list(model.parameters())
    mpigrad.broadcast([p.detach().numpy() for p in params], root=0)
    for p in params:
        p.grad = torch.zeros_like(p)                   # stable gradient storage
    grads = [p.grad for p in params]
    optimizer = torch.optim.SGD(params, lr=0.05)
    pending = {}
    for index, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _, i=index: pending["handle"].ready(i))
    with mpigrad.Reducer(bucket_bytes=4096) as reducer:
        for _ in range(steps):
            x = torch.randn(32, 16)
            loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
            optimizer.zero_grad(set_to_none=False)
            pending["handle"] = reducer.start(grads)
            loss.backward()                            # buckets go out as they fill
            pending["handle"].wait()
            optimizer.step()
    weights = comm.gather(params[0].detach().numpy().copy())
    if comm.rank == 0:
        same = all((w == weights[0]).all() for w in weights)
        print(f"final loss {loss.item():.4f}; parameters identical on all ranks: {same}")


if __name__ == "__main__":
    main()

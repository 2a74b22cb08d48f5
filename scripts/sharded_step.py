"""A sharded Adam step (mpigrad.shard.Sharded: reduce-scatter, Adam on this
rank's shard, allgather) against an unsharded one (reduce in place, Adam on
every element), on a layout's float32 parameter shapes (ResNet-50 by
default); with ``--torch``, torch's Adam through ShardedOptimizer against
DistributedOptimizer instead (the bench's cases, without the rest of the
bench: BERT-base's fits in memory here); interleaved (the bench's timing),
min and median of 10; and the Adam state bytes per rank.

    mpiexec -n 2 python scripts/sharded_step.py [--layout bert_base] [--torch]
"""

import argparse


import numpy as np
from mpi4py import MPI

import mpigrad
from mpigrad.bench.layouts import load_layout
from mpigrad.bench.timing import time_interleaved
from mpigrad.shard import Sharded


def adam_init(params):
    return {"t": 0, "m": {k: np.zeros_like(p) for k, p in params.items()},
            "v": {k: np.zeros_like(p) for k, p in params.items()}}


def adam(params, grads, state, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
    state["t"] += 1
    c1, c2 = 1 - b1 ** state["t"], 1 - b2 ** state["t"]
    for key in params:
        m, v, g = state["m"][key], state["v"][key], grads[key]
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * g * g
        params[key] -= lr * (m / c1) / (np.sqrt(v / c2) + eps)
    return state


def torch_steps(comm, shapes):
    """The bench's two torch Adam step cases, timed alone."""
    from mpigrad.bench.optimizer import optimizer_cases
    cases, _, free = optimizer_cases(shapes, np.float32, None, True, sharded=True)
    adam = {name: case for name, case in cases.items() if "Adam" in name}
    times = time_interleaved(comm, adam, repeats=10)
    free()
    if comm.rank == 0:
        for name, timing in times.items():
            print(f"{name}: min {timing.min * 1e3:.1f} ms, median {timing.median * 1e3:.1f} ms")
        sharded, distributed = (times[f"torch {k}Optimizer Adam step"].min
                                for k in ("Sharded", "Distributed"))
        print(f"ShardedOptimizer / DistributedOptimizer (min): {sharded / distributed:.3f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="resnet50")
    parser.add_argument("--torch", action="store_true")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    shapes = load_layout(args.layout)
    if args.torch:
        torch_steps(comm, shapes)
        return
    grads = [np.full(s, comm.rank + 1.0, np.float32) for s in shapes]
    sharded_params = [np.zeros(s, np.float32) for s in shapes]
    full_params = {i: np.zeros(s, np.float32) for i, s in enumerate(shapes)}
    with mpigrad.Reducer() as reducer:
        step = Sharded(sharded_params, adam, init=adam_init, reducer=reducer)
        state = adam_init(full_params)

        def unsharded():
            reducer.reduce(grads, inplace=True)
            adam(full_params, dict(enumerate(grads)), state)

        cases = {"sharded step": lambda: step(grads), "reduce + Adam": unsharded}
        times = time_interleaved(comm, cases, repeats=10)
        full_state = sum(a.nbytes for a in (*state["m"].values(), *state["v"].values()))
        mine = sum(a.nbytes for a in (*step.state["m"].values(), *step.state["v"].values()))
    if comm.rank == 0:
        for name, timing in times.items():
            print(f"{name}: min {timing.min * 1e3:.1f} ms, median {timing.median * 1e3:.1f} ms")
        ratio = times["sharded step"].min / times["reduce + Adam"].min
        print(f"sharded / unsharded (min): {ratio:.3f}")
        print(f"Adam state per rank: {mine / 2**20:.1f} MiB sharded, {full_state / 2**20:.1f} MiB "
              f"unsharded ({mine / full_state:.3f} of it, 1/p = {1 / comm.size:.3f})")


if __name__ == "__main__":
    main()

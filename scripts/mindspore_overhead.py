"""The reduction's time per step of mpigrad.mindspore.DistributedGradReducer
(called in PyNative mode, and compiled: inside ``ms.jit``, its GRAPH_MODE
path, returning every reduced gradient, and shaped as a training step: the reduced
gradients kept in the step, one returned; beside each, the same compiled step whose
host call does nothing: MindSpore's own cost of a step of that many tensors in and
out) against the same sums by a
bare mpi4py ``Allreduce`` per gradient (the
loop a MindSpore user writes without it: ``asnumpy``, ``Allreduce``, the
mean, ``Tensor.from_numpy``), on a model's gradient shapes as MindSpore
float32 tensors; interleaved rounds, min and median of the per-step times.
MindSpore writes ``rank_*/`` folders where it compiles: run it where that
is harmless.

    mpiexec -n 2 python scripts/mindspore_overhead.py [--layout lenet|resnet50|bert_base]
"""

import argparse
import os
import statistics
import sys
import time

import mindspore as ms
import numpy as np
from mpi4py import MPI

from mpigrad.bench.layouts import LAYOUTS, load_layout
from mpigrad.mindspore import DistributedGradReducer
from mpigrad.mindspore.host_call import HostOp

# the loop without mpigrad, as examples/mindspore/value_and_grad.py --compare times it
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "mindspore"))
from lenet import make_model  # noqa: E402
from value_and_grad import bare_allreduce  # noqa: E402


def per_step(reduce, grads, steps, comm):
    """Seconds per step: each step starts at a barrier (every rank's gradients ready)."""
    times = []
    for _ in range(steps):
        comm.Barrier()
        start = time.perf_counter()
        reduce(grads)
        times.append(time.perf_counter() - start)
    return comm.allreduce(statistics.median(times), op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="lenet", choices=("lenet",) + LAYOUTS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    shapes = ([tuple(p.shape) for p in make_model().trainable_params()]
              if args.layout == "lenet" else load_layout(args.layout))
    rng = np.random.default_rng(comm.rank)
    grads = tuple(ms.Tensor(rng.standard_normal(s, np.float32)) for s in shapes)
    params = [ms.Parameter(ms.Tensor(np.zeros(s, np.float32)), name=f"p{i}")
              for i, s in enumerate(shapes)]
    compiled_reducer = DistributedGradReducer(params, mean=True)

    @ms.jit
    def compiled(*gradients):
        return compiled_reducer(gradients)

    # a training step's shape: the reduced gradients stay in the step (its optimizer's),
    # one comes out; returning all of them costs MindSpore ~25 us a tensor more
    @ms.jit
    def compiled_kept(*gradients):
        return compiled_reducer(gradients)[0]

    def in_graph(gradients):
        return compiled(*gradients)[0].asnumpy()      # waited for

    def kept_in_graph(gradients):
        return compiled_kept(*gradients).asnumpy()

    # MindSpore's own cost of such a step: the same host call, doing nothing
    nothing = HostOp(shapes, [ms.float32] * len(shapes), lambda arrays, outputs: None,
                     lambda arrays: tuple(arrays))

    key = nothing.key_tensor
    keyed = () if key is None else (key,)             # (no compiler: the pyfunc op, unkeyed)

    @ms.jit
    def compiled_nothing(*gradients):
        return nothing.op(*keyed, *gradients)

    @ms.jit
    def compiled_nothing_kept(*gradients):
        return nothing.op(*keyed, *gradients)[0]

    def empty_graph(gradients):
        return compiled_nothing(*gradients)[0].asnumpy()

    def empty_kept(gradients):
        return compiled_nothing_kept(*gradients).asnumpy()

    cases = {"DistributedGradReducer": DistributedGradReducer(params, mean=True),
             "DistributedGradReducer, compiled": in_graph,
             "compiled, a host call doing nothing": empty_graph,
             "compiled, results kept in the step": kept_in_graph,
             "compiled, kept, a host call doing nothing": empty_kept,
             "bare Allreduce per gradient": bare_allreduce(comm)}
    for reduce in cases.values():
        per_step(reduce, grads, 3, comm)                  # warm: buffers, plans
    seen = {name: [] for name in cases}
    for _ in range(args.rounds):                          # interleaved
        for name, reduce in cases.items():
            seen[name].append(per_step(reduce, grads, args.steps, comm))
    cases["DistributedGradReducer"].free()
    compiled_reducer.free()
    if comm.rank == 0:
        elements = sum(int(np.prod(s)) for s in shapes)
        print(f"{args.layout}: {len(shapes)} gradients, {elements * 4 / 2**20:.1f} MiB float32, "
              f"{comm.size} ranks; ms per step, min / median of {args.rounds} rounds "
              f"(each the median of {args.steps} steps)")
        base = min(seen["bare Allreduce per gradient"])
        for name, times in seen.items():
            print(f"  {name:42s} {min(times) * 1e3:8.3f} / {statistics.median(times) * 1e3:8.3f}"
                  f"   {min(times) / base:.2f}x")


if __name__ == "__main__":
    main()

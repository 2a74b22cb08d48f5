"""MindSpore's own ``nn.DistributedGradReducer`` on CPU (its "mccl"
collectives: launched by ``msrun``, with ``mindspore.communication.init()``),
timed on a model's gradient shapes as float32 tensors: the baseline
``scripts/mindspore_overhead.py`` compares mpigrad's reducer against (run
both on the same machine, one after the other). MindSpore writes ``rank_*/``
folders where it runs: run it where that is harmless.

    msrun --worker_num=2 --local_worker_num=2 --master_port=8129 --join=True \\
        scripts/mindspore_mccl.py [--layout resnet50] [--graph]
"""

import argparse
import os
import statistics
import sys
import time

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mpigrad.bench.layouts import LAYOUTS, load_layout  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="resnet50", choices=LAYOUTS)
    parser.add_argument("--graph", action="store_true", help="GRAPH_MODE (default PyNative)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE if args.graph else ms.PYNATIVE_MODE, device_target="CPU")
    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL,
                                 gradients_mean=True)
    rank, size = get_rank(), get_group_size()
    shapes = load_layout(args.layout)
    params = [ms.Parameter(ms.Tensor(np.zeros(s, np.float32)), name=f"p{i}")
              for i, s in enumerate(shapes)]
    grads = tuple(ms.Tensor(np.full(s, rank + 1.0, np.float32)) for s in shapes)
    reducer = nn.DistributedGradReducer(params, mean=True, degree=size)
    right = float(reducer(grads)[0].asnumpy().ravel()[0]) == (size + 1) / 2
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        reducer(grads)[-1].asnumpy()                   # waited for
        times.append(time.perf_counter() - start)
    if rank == 0:
        mode = "GRAPH_MODE" if args.graph else "PyNative"
        print(f"{args.layout}: MindSpore's nn.DistributedGradReducer (mccl, {mode}), {size} "
              f"ranks: {min(times) * 1e3:.1f} / {statistics.median(times) * 1e3:.1f} ms per "
              f"call (min / median of {args.steps}); right: {right}")


if __name__ == "__main__":
    main()

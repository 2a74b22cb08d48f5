"""A functional MindSpore training loop (``ms.value_and_grad``, PyNative)
data-parallel over MPI ranks with mpigrad's DistributedGradReducer: LeNet-5
for 100 steps.

    mpiexec -n 2 python examples/mindspore/value_and_grad.py [--compare]

No ``msrun``, scheduler or ``mindspore.communication.init()``: the ranks are
MPI's. Rank 0's initial weights are broadcast, each step's gradients are
averaged by the reducer, and the loss is averaged over the ranks for the
log. Each rank then trains the same model on the whole batch alone (1
rank's training), and the example checks that both give the same losses
(relative: a float32 mean's last bit is 2.4e-7 at 2.3) and weights within
TOLERANCE, bitwise alike on every rank. ``--compare``
also trains with a bare mpi4py ``Allreduce`` per gradient and prints both
reductions' time per step, each timed from a barrier after backward
(docs/mindspore.md's measurement).
"""

import argparse
import sys
import time

import mindspore as ms
import numpy as np
from mindspore import nn
from mpi4py import MPI

from lenet import batches, identical_on_every_rank, make_model, max_difference
from mpigrad.mindspore import DistributedGradReducer, allreduce, broadcast_parameters

STEPS, BATCH, LR = 100, 12, 0.01
TOLERANCE = 1e-6


def train(model, reduce, rank, size, barrier=lambda: None):
    """Train ``model`` for STEPS steps; (this rank's losses, the median
    seconds per step of ``reduce``: the gradients are final, and with
    ``barrier`` every rank's, when it starts)."""
    optimizer = nn.Momentum(model.trainable_params(), learning_rate=LR, momentum=0.9)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def forward(x, y):
        return loss_fn(model(x), y)

    # forward and backward compiled (jit); the reducer and the step run in PyNative
    grad_fn = ms.jit(ms.value_and_grad(forward, None, optimizer.parameters))
    losses, times = [], []
    for x, y in batches(STEPS, BATCH, rank, size):
        loss, grads = grad_fn(x, y)
        for grad in grads:
            grad.asnumpy()                   # PyNative runs ahead: wait for backward
        barrier()
        start = time.perf_counter()
        grads = reduce(grads)
        times.append(time.perf_counter() - start)
        optimizer(grads)
        losses.append(float(loss.asnumpy()))
    return losses, sorted(times)[len(times) // 2]


def bare_allreduce(comm):
    """The sums of a loop without mpigrad: an mpi4py Allreduce per gradient."""
    def reduce(grads):
        out = []
        for grad in grads:
            total = np.empty_like(grad.asnumpy())
            comm.Allreduce(grad.asnumpy(), total)
            total *= np.float32(1 / comm.size)
            out.append(ms.Tensor.from_numpy(total))
        return tuple(out)
    return reduce


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", action="store_true",
                        help="also time a bare Allreduce per gradient")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    model = make_model()
    broadcast_parameters(model.trainable_params(), root=0)
    barrier = comm.Barrier if args.compare else (lambda: None)   # time the sums alone
    with DistributedGradReducer(model.trainable_params(), mean=True) as grad_reducer:
        losses, t_mpigrad = train(model, grad_reducer, comm.rank, comm.size, barrier)
    losses = [allreduce(loss) for loss in losses]          # the whole batch's mean loss

    alone = make_model()
    losses_alone, _ = train(alone, lambda grads: grads, 0, 1)
    weights = max_difference(model.trainable_params(), alone.trainable_params())
    loss_gap = max(abs(a - b) / abs(b) for a, b in zip(losses, losses_alone))
    identical = identical_on_every_rank(comm, model.trainable_params())
    ok = comm.allreduce(weights <= TOLERANCE and loss_gap <= TOLERANCE, MPI.LAND) and identical
    if args.compare:
        _, t_bare = train(make_model(), bare_allreduce(comm), comm.rank, comm.size, barrier)
        t_mpigrad, t_bare = (comm.allreduce(t, op=MPI.MAX) for t in (t_mpigrad, t_bare))
    if comm.rank == 0:
        print(f"{comm.size} ranks: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {STEPS} steps; "
              f"against 1 rank on the whole batch: losses within {loss_gap:.1e} (relative), "
              f"weights {weights:.1e} (tolerance {TOLERANCE:g}); identical on all ranks: "
              f"{identical}")
        if args.compare:
            print(f"reduction per step: DistributedGradReducer {t_mpigrad * 1e6:.0f} us, a "
                  f"bare Allreduce per gradient {t_bare * 1e6:.0f} us (median of {STEPS}, "
                  f"{len(model.trainable_params())} gradients)")
        print("claims hold:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

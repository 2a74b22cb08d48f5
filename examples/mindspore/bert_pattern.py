"""BERT's distributed step in MindSpore's model zoo, on mpigrad: the
reducer with ``mean=False`` (the caller divides by ``degree`` and the loss
scale), gradient accumulation that reduces only at the boundary, and the
overflow flag agreed across ranks before the update (PyNative, CPU).

    mpiexec -n 2 python examples/mindspore/bert_pattern.py

Each step accumulates ACCUMULATE micro-batches locally (each rank its shard
of every micro-batch), then reduces the sum once, unscales by
``loss_scale * degree * ACCUMULATE`` and clips by global norm. The overflow
flag is the reducer's finite check (``check_finite=True``: the same on every
rank) or ``allreduce(flag, "max")`` of each rank's own check (``--flag
allreduce``); on overflow the step is skipped and the loss scale halved, as
BERT's DynamicLossScaleUpdateCell does. An inf is injected into one rank's
gradient at step OVERFLOW_STEP. The example checks that every rank skips
that step and only it, and that N ranks end with the weights of 1 rank
trained on the whole batch (within TOLERANCE), bitwise alike on every rank.
"""

import argparse
import sys

import mindspore as ms
import numpy as np
from mindspore import nn, ops
from mpi4py import MPI

from lenet import identical_on_every_rank, max_difference
from mpigrad.mindspore import DistributedGradReducer, allreduce, broadcast_parameters

STEPS, ACCUMULATE, MICRO_BATCH, LR = 12, 4, 12, 0.05
LOSS_SCALE, OVERFLOW_STEP = 2.0 ** 12, 5
TOLERANCE = 1e-6


def make_network():
    ms.set_seed(0)
    return nn.SequentialCell([nn.Dense(16, 64), nn.Tanh(), nn.Dense(64, 4)])


def micro_batches(rank, size):
    """STEPS x ACCUMULATE micro-batches, this rank's shard of each."""
    rng = np.random.default_rng(1)
    teacher = rng.standard_normal((16, 4)).astype(np.float32)
    per = MICRO_BATCH // size
    for _ in range(STEPS * ACCUMULATE):
        x = rng.standard_normal((MICRO_BATCH, 16)).astype(np.float32)
        y = (x @ teacher).argmax(axis=1).astype(np.int32)
        yield ms.Tensor(x[rank * per:(rank + 1) * per]), ms.Tensor(y[rank * per:(rank + 1) * per])


def train(rank, size, flag_by):
    """(weights, steps skipped): BERT's loop over this rank's shards."""
    network = make_network()
    params = network.trainable_params()
    reducer = None
    if size > 1:
        broadcast_parameters(params, root=0)
        reducer = DistributedGradReducer(params, mean=False, check_finite=flag_by == "reducer")
    # Momentum: one of BERT's optimizers (Lamb has no CPU kernel in MindSpore 2.10)
    optimizer = nn.Momentum(params, learning_rate=LR, momentum=0.9)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(network(x), y) * scale, None, params)
    scale, skipped, accumulated = LOSS_SCALE, [], None
    for i, (x, y) in enumerate(micro_batches(rank, size)):
        step = i // ACCUMULATE
        _, grads = grad_fn(x, y)
        if step == OVERFLOW_STEP and i % ACCUMULATE == 0 and rank == size - 1:
            grads = (grads[0] * ms.Tensor(np.float32(np.inf)),) + tuple(grads[1:])
        accumulated = grads if accumulated is None else tuple(
            a + g for a, g in zip(accumulated, grads))
        if i % ACCUMULATE != ACCUMULATE - 1:
            continue                                  # no communication between boundaries
        grads, accumulated = accumulated, None
        if reducer is not None:
            grads = reducer(grads)
        if reducer is not None and flag_by == "reducer":
            overflow = not reducer.finite
        else:
            mine = not all(bool(ops.isfinite(g).all().asnumpy()) for g in grads)
            overflow = bool(allreduce(ms.Tensor(np.int32(mine)), "max").asnumpy()) \
                if size > 1 else mine
        if overflow:
            skipped.append(step)
            scale /= 2
            continue
        grads = tuple(g / (scale * size * ACCUMULATE) for g in grads)
        grads = ops.clip_by_global_norm(grads, 1.0)
        optimizer(grads)
    if reducer is not None:
        reducer.free()
    return params, skipped


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flag", choices=["reducer", "allreduce"], default="reducer",
                        help="the overflow flag: the reducer's finite check or an allreduce")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    mine, skipped = train(comm.rank, comm.size, args.flag)
    alone, skipped_alone = train(0, 1, args.flag)
    deviation = max_difference(mine, alone)
    identical = identical_on_every_rank(comm, mine)
    same_skips = comm.allgather(skipped) == [[OVERFLOW_STEP]] * comm.size
    ok = (comm.allreduce(deviation <= TOLERANCE, MPI.LAND) and identical and same_skips
          and skipped_alone == [OVERFLOW_STEP])
    if comm.rank == 0:
        print(f"{comm.size} ranks, overflow flag by {args.flag}: steps skipped {skipped} on "
              f"every rank: {same_skips}; against 1 rank on the whole batch after {STEPS} "
              f"steps of {ACCUMULATE} micro-batches: weights within {deviation:.1e} "
              f"(tolerance {TOLERANCE:g}); identical on all ranks: {identical}")
        print("claims hold:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

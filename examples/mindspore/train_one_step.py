"""MindSpore's model-zoo pattern: a custom TrainOneStepCell whose
``grad_reducer`` is mpigrad's DistributedGradReducer (CPU; PyNative, or the
whole step compiled with ``--graph``: GRAPH_MODE).

    mpiexec -n 2 python examples/mindspore/train_one_step.py [--graph]

The cell is the zoo's (``ops.GradOperation`` with a sensitivity, then the
reducer, then the optimizer); only the reducer's import changes, and no
``init()`` is called: the ranks are MPI's. The mean over the ranks comes
from the auto-parallel context's ``gradients_mean``, as in MindSpore. The
example checks that N ranks end with the weights of 1 rank trained on the
whole batch (within TOLERANCE), bitwise alike on every rank.
"""

import sys

import mindspore as ms
import numpy as np
from mindspore import nn, ops
from mpi4py import MPI

from lenet import identical_on_every_rank, max_difference
from mpigrad.mindspore import DistributedGradReducer, broadcast_parameters, get_group_size

STEPS, BATCH, LR = 40, 24, 0.1
TOLERANCE = 1e-6


class TrainOneStepCell(nn.Cell):
    """The zoo's training cell: loss, gradients, reduced gradients, step."""

    def __init__(self, network, optimizer, distributed, sens=1.0):
        super().__init__(auto_prefix=False)
        self.network = network
        self.network.set_grad()
        self.optimizer = optimizer
        self.weights = optimizer.parameters
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.sens = sens
        self.grad_reducer = (DistributedGradReducer(self.weights) if distributed
                             else ops.identity)

    def construct(self, *inputs):
        loss = self.network(*inputs)
        sens = ops.fill(loss.dtype, loss.shape, self.sens)
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        grads = self.grad_reducer(grads)
        self.optimizer(grads)
        return loss


def make_network():
    ms.set_seed(0)
    net = nn.SequentialCell([nn.Dense(16, 64), nn.ReLU(), nn.Dense(64, 64), nn.ReLU(),
                             nn.Dense(64, 4)])
    return nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True,
                                                                 reduction="mean"))


def train(rank, size, distributed):
    network = make_network()
    if distributed:
        broadcast_parameters(network.trainable_params(), root=0)
    optimizer = nn.Momentum(network.trainable_params(), learning_rate=LR, momentum=0.9)
    step = TrainOneStepCell(network, optimizer, distributed)
    rng = np.random.default_rng(1)
    teacher = rng.standard_normal((16, 4)).astype(np.float32)
    per = BATCH // size
    for _ in range(STEPS):
        x = rng.standard_normal((BATCH, 16)).astype(np.float32)
        y = (x @ teacher).argmax(axis=1).astype(np.int32)
        step(ms.Tensor(x[rank * per:(rank + 1) * per]), ms.Tensor(y[rank * per:(rank + 1) * per]))
    if distributed:
        step.grad_reducer.free()
    return network.trainable_params()


def main():
    comm = MPI.COMM_WORLD
    graph = "--graph" in sys.argv[1:]
    ms.set_context(mode=ms.GRAPH_MODE if graph else ms.PYNATIVE_MODE, device_target="CPU")
    ms.set_auto_parallel_context(gradients_mean=True)     # the reducer's mean=None reads it
    mine = train(comm.rank, get_group_size(), distributed=True)
    alone = train(0, 1, distributed=False)
    deviation = max_difference(mine, alone)
    identical = identical_on_every_rank(comm, mine)
    ok = comm.allreduce(deviation <= TOLERANCE, MPI.LAND) and identical
    if comm.rank == 0:
        print(f"{'GRAPH_MODE' if graph else 'PyNative'}: "
              f"{comm.size} ranks against 1 rank on the whole batch after {STEPS} steps: "
              f"weights within {deviation:.1e} (tolerance {TOLERANCE:g}); identical on all "
              f"ranks: {identical}")
        print("claims hold:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

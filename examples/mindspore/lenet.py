"""What the MindSpore examples share: a LeNet-5 on 32x32 synthetic images,
each step's batch cut into the ranks' shards, and the two checks of their
claims (N ranks against 1 rank on the whole batch; the same weights on
every rank)."""

import mindspore as ms
import numpy as np
from mindspore import nn
from mpi4py import MPI


class LeNet5(nn.Cell):
    """LeNet-5 (61,684 parameters in 8 tensors: the convolutions have no bias), as
    MindSpore's model zoo has it."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, pad_mode="valid")
        self.conv2 = nn.Conv2d(6, 16, 5, pad_mode="valid")
        self.fc1 = nn.Dense(16 * 5 * 5, 120)
        self.fc2 = nn.Dense(120, 84)
        self.fc3 = nn.Dense(84, classes)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.flatten = nn.Flatten()

    def construct(self, x):
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = self.flatten(x)
        return self.fc3(self.relu(self.fc2(self.relu(self.fc1(x)))))


def make_model(seed: int = 0) -> LeNet5:
    """The same initial weights everywhere (the examples still broadcast rank 0's)."""
    ms.set_seed(seed)
    return LeNet5()


def batches(steps: int, batch: int, rank: int, size: int, seed: int = 1):
    """``steps`` batches of ``batch`` images (the whole batch), each as this
    rank's contiguous shard: (images, labels) as MindSpore tensors. Each
    image is its class's template under noise."""
    rng = np.random.default_rng(seed)
    templates = rng.standard_normal((10, 1, 32, 32)).astype(np.float32)
    per = batch // size
    for _ in range(steps):
        y = rng.integers(0, 10, batch).astype(np.int32)
        x = templates[y] + 2 * rng.standard_normal((batch, 1, 32, 32)).astype(np.float32)
        yield ms.Tensor(x[rank * per:(rank + 1) * per]), ms.Tensor(y[rank * per:(rank + 1) * per])


def max_difference(a, b) -> float:
    """The largest absolute difference between two lists of parameters."""
    return max(float(np.abs(p.asnumpy() - q.asnumpy()).max()) for p, q in zip(a, b))


def identical_on_every_rank(comm, params) -> bool:
    """Whether every rank holds bitwise rank 0's ``params`` (the same on every rank)."""
    blobs = [p.asnumpy().tobytes() for p in params]
    return bool(comm.allreduce(blobs == comm.bcast(blobs), op=MPI.LAND))

"""A Horovod-style MNIST script on mpigrad: the only Horovod-specific line is
``import mpigrad.horovod.torch as hvd``. MNIST-shaped synthetic data (no
download): 28x28 images, each one of ten fixed random templates plus noise,
labelled by its template.

    mpiexec -n 2 python examples/horovod/mnist.py

Each rank trains on its shard of the training set; the learning rate scales
with the ranks; the test metrics are averaged with hvd.allreduce, as in
Horovod's example. It exits non-zero unless the test accuracy reaches 0.9
and the parameters are identical on every rank.
"""

import sys

import torch
import torch.nn.functional as F

import mpigrad.horovod.torch as hvd

EPOCHS, BATCH, LR = 4, 32, 0.01


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, kernel_size=5)
        self.conv2 = torch.nn.Conv2d(8, 16, kernel_size=5)
        self.fc1 = torch.nn.Linear(256, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.flatten(1)))), dim=1)


def synthetic_mnist(count, seed):
    templates = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(99))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (count,), generator=g)
    return templates[labels] + 1.5 * torch.randn(count, 1, 28, 28, generator=g), labels


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main():
    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    train_x, train_y = synthetic_mnist(4096, seed=1)
    test_x, test_y = synthetic_mnist(1024, seed=2)
    mine = slice(hvd.rank(), None, hvd.size())            # this rank's shard
    train_x, train_y, test_x, test_y = train_x[mine], train_y[mine], test_x[mine], test_y[mine]

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * hvd.size(), momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    for epoch in range(EPOCHS):
        model.train()
        for start in range(0, len(train_x), BATCH):
            optimizer.zero_grad()
            loss = F.nll_loss(model(train_x[start:start + BATCH]), train_y[start:start + BATCH])
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            out = model(test_x)
            test_loss = metric_average(F.nll_loss(out, test_y).item(), "avg_loss")
            accuracy = metric_average((out.argmax(1) == test_y).float().mean().item(),
                                      "avg_accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: test loss {test_loss:.4f}, accuracy {accuracy:.3f}")
    blobs = hvd.allgather_object([p.detach().numpy().tobytes() for p in model.parameters()])
    identical = all(b == blobs[0] for b in blobs)
    ok = accuracy >= 0.9 and identical
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks: parameters identical on every rank: {identical}")
        print(f"claims hold: {ok}")
    optimizer.free()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""mpigrad.torch.DistributedOptimizer: N ranks with per-rank batch b train as
1 rank with batch N*b (SGD and Adam; fp32, bf16, fp16 parameters), bitwise
identical across ranks after every step, whatever zero_grad is called;
accumulation, no_sync, unused parameters, the agreed overflow flag with
GradScaler, and the broadcasts. Run under mpiexec -n 2 and -n 3."""

import pytest

torch = pytest.importorskip("torch")

import mpigrad.torch as mgt  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=2)

STEPS = 4


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def data(size, rows=32):
    g = torch.Generator().manual_seed(7)
    return torch.randn(rows * size, 5, generator=g), torch.randn(rows * size, 2, generator=g)


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, 2)).to(dtype)
        self.unused = torch.nn.Linear(5, 2).to(dtype)      # a branch some ranks skip

    def forward(self, x, branch=False):
        out = self.body(x)
        return out + self.unused(x) if branch else out


def optimizer_for(name, params):
    return {"sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            # eps representable in float16 (the default 1e-8 is 0 there: steps of inf)
            "adam": lambda: torch.optim.Adam(params, lr=0.01, eps=1e-4)}[name]()


def loss_of(model, x, y, branch=False):
    out = model(x.to(next(model.parameters()).dtype), branch)
    return torch.nn.functional.mse_loss(out.float(), y)


def one_rank_reference(name, dtype, size, steps=STEPS):
    x, y = data(size)
    model = Net(dtype)
    opt = optimizer_for(name, model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    return model


def assert_identical_across_ranks(comm, model):
    mine = [p.detach().float().numpy().tobytes() for p in model.parameters()]
    assert mine == comm.bcast(mine, root=0), "parameters differ across ranks (bitwise)"


def max_deviation(model, reference):
    return max(float((a.detach().float() - b.detach().float()).abs().max())
               for a, b in zip(model.body.parameters(), reference.body.parameters()))


# float32: rounding of the gradient sums in another order, carried through a
# few steps; SGD in half precision: a few units in the last place of weights
# ~0.5; Adam in half precision: its update is about lr times the sign of a
# gradient, and a gradient near 0 can round to either sign, so the bound is
# the largest move, 2 lr per step
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
ADAM_HALF_TOLERANCE = 2 * 0.01 * STEPS


@pytest.mark.parametrize("name", ["sgd", "adam"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zeros"])
def test_equals_one_rank_full_batch_and_ranks_stay_identical(comm, name, dtype, set_to_none):
    x, y = data(comm.size)
    shard = slice(comm.rank, None, comm.size)
    model = Net(dtype)
    opt = mgt.DistributedOptimizer(optimizer_for(name, model.parameters()))
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        loss_of(model, x[shard], y[shard]).backward()
        opt.step()
        assert_identical_across_ranks(comm, model)
        assert opt.finite is True
    reference = one_rank_reference(name, dtype, comm.size)
    half_adam = name == "adam" and dtype != torch.float32
    assert max_deviation(model, reference) <= (ADAM_HALF_TOLERANCE if half_adam
                                               else TOLERANCE[dtype])
    opt.free()


def test_module_zero_grad_and_grads_stay_in_bucket_memory(comm):
    x, y = data(comm.size)
    model = Net()
    opt = mgt.DistributedOptimizer(optimizer_for("sgd", model.parameters()))
    storage = [p.grad.data_ptr() for p in model.parameters()]
    for _ in range(3):
        model.zero_grad(set_to_none=True)                 # the module's, not ours
        loss_of(model, x[comm.rank::comm.size], y[comm.rank::comm.size]).backward()
        opt.step()
        assert [p.grad.data_ptr() for p in model.parameters()] == storage
    assert_identical_across_ranks(comm, model)
    assert max_deviation(model, one_rank_reference("sgd", torch.float32, comm.size, 3)) < 1e-5
    opt.free()


def test_reproducible_reduces_to_the_exact_mean_of_every_ranks_gradients(comm):
    """DistributedOptimizer(reproducible=True): each step's gradients are the
    exact mean of the ranks' gradients, rounded once (their bits known from
    every rank's gradients, whatever the rank count)."""
    import numpy as np
    from helpers import exact_reference
    x, y = data(comm.size)
    model = Net()
    opt = mgt.DistributedOptimizer(optimizer_for("sgd", model.parameters()), reproducible=True)
    for _ in range(2):
        opt.zero_grad()
        loss_of(model, x[comm.rank::comm.size], y[comm.rank::comm.size]).backward()
        local = [p.grad.numpy().copy() for p in model.parameters()]
        opt.synchronize()
        every = comm.allgather(local)
        for got, want in zip(model.parameters(), exact_reference(every, comm.size)):
            assert np.array_equal(got.grad.numpy().view(np.uint32), want.view(np.uint32))
        with opt.skip_synchronize():
            opt.step()
    assert_identical_across_ranks(comm, model)
    opt.free()


@pytest.mark.parametrize("how", ["backward_passes_per_step", "no_sync"])
def test_accumulation_equals_full_batch(comm, how):
    x, y = data(comm.size)
    mine_x, mine_y = x[comm.rank::comm.size], y[comm.rank::comm.size]
    halves = [(mine_x[:16], mine_y[:16]), (mine_x[16:], mine_y[16:])]
    model = Net()
    passes = 2 if how == "backward_passes_per_step" else 1
    opt = mgt.DistributedOptimizer(optimizer_for("sgd", model.parameters()),
                                   backward_passes_per_step=passes)
    for _ in range(STEPS):
        opt.zero_grad()
        if how == "no_sync":
            with opt.no_sync():
                (loss_of(model, *halves[0]) / 2).backward()
        else:
            (loss_of(model, *halves[0]) / 2).backward()
        (loss_of(model, *halves[1]) / 2).backward()
        opt.step()
    assert_identical_across_ranks(comm, model)
    assert max_deviation(model, one_rank_reference("sgd", torch.float32, comm.size)) < 1e-5
    opt.free()


def test_unused_parameters_on_some_ranks_count_as_zero(comm):
    x, y = data(comm.size)
    model = Net()
    opt = mgt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        branch = comm.rank == 0                      # only rank 0 uses the branch
        loss_of(model, x[comm.rank::comm.size], y[comm.rank::comm.size], branch).backward()
        opt.step()
    assert_identical_across_ranks(comm, model)
    opt.free()


def test_inf_on_one_rank_skips_the_step_everywhere(comm):
    x, y = data(comm.size)
    model = Net()
    opt = mgt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss = loss_of(model, x[comm.rank::comm.size], y[comm.rank::comm.size])
    (loss * (float("inf") if comm.rank == comm.size - 1 else 1.0)).backward()
    opt.synchronize()
    flags = comm.allgather(opt.finite)
    assert flags == [False] * comm.size
    if opt.finite:
        with opt.skip_synchronize():
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    opt.free()


def test_grad_scaler_clipping_and_skip_synchronize(comm):
    x, y = data(comm.size)
    model = Net()
    opt = mgt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    skipped = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, x[comm.rank::comm.size], y[comm.rank::comm.size])
        if step == 1 and comm.rank == comm.size - 1:
            loss = loss * float("inf")               # one rank overflows at step 1
        scaler.scale(loss).backward()
        opt.synchronize()                            # reduce before unscale_ and clipping
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = [p.detach().clone() for p in model.parameters()]
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(a, b) for a, b in zip(model.parameters(), before)))
    assert comm.allgather(skipped) == [[False, True, False, False]] * comm.size
    assert_identical_across_ranks(comm, model)
    opt.free()


def test_broadcasts_restore_parameters_and_adam_state(comm):
    x, y = data(comm.size)
    torch.manual_seed(comm.rank)                    # every rank starts different
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4))
    model[1].num_batches_tracked += comm.rank
    mgt.broadcast_parameters(model.state_dict(), root=0)
    assert_identical_across_ranks(comm, model)
    assert int(model[1].num_batches_tracked) == 0
    adam = torch.optim.Adam(model.parameters(), lr=0.01 * (comm.rank + 1), betas=(0.8, 0.9))
    if comm.rank == 0:                               # only the root has state
        model(x[:8]).sum().backward()
        adam.step()
    mgt.broadcast_optimizer_state(adam, root=0)
    state = adam.state_dict()
    root = comm.bcast(state, root=0)
    assert state["param_groups"][0]["lr"] == 0.01 and isinstance(
        state["param_groups"][0]["betas"], tuple)
    for k, v in root["state"].items():
        assert all(torch.equal(v[n], state["state"][k][n]) for n in v)


def test_two_optimizers_on_disjoint_parameters_with_requires_grad_switched(comm):
    x, y = data(comm.size)
    torch.manual_seed(0)
    g, d = torch.nn.Linear(5, 5), torch.nn.Linear(5, 2)
    g_opt = mgt.DistributedOptimizer(torch.optim.SGD(g.parameters(), lr=0.1))
    d_opt = mgt.DistributedOptimizer(torch.optim.SGD(d.parameters(), lr=0.1))
    for _ in range(3):                               # a GAN's alternation
        for p in g.parameters():
            p.requires_grad_(False)
        d_opt.zero_grad()
        torch.nn.functional.mse_loss(d(g(x[comm.rank::comm.size])), y[comm.rank::comm.size]
                                     ).backward()
        d_opt.step()
        for p in g.parameters():
            p.requires_grad_(True)
        for p in d.parameters():
            p.requires_grad_(False)
        g_opt.zero_grad()
        d(g(x[comm.rank::comm.size])).pow(2).mean().backward()
        g_opt.step()
        for p in d.parameters():
            p.requires_grad_(True)
    assert_identical_across_ranks(comm, g)
    assert_identical_across_ranks(comm, d)
    g_opt.free()
    d_opt.free()


OPTIMIZERS = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam",
              "RAdam", "ASGD", "Rprop"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_state_and_group_options_restored_for_every_optimizer(comm, name):
    kind = getattr(torch.optim, name)
    model = Net()
    mine = kind(model.parameters(), lr=0.01 * (comm.rank + 1))   # options differ per rank
    x, y = data(comm.size)
    if comm.rank == 0:                  # only the root has state (a local step, unwrapped)
        loss_of(model, x, y).backward()
        mine.step()
    opt = mgt.DistributedOptimizer(mine)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    mgt.broadcast_optimizer_state(opt, root=0)
    state = opt.state_dict()
    root = comm.bcast(state, root=0)
    for mine_group, root_group in zip(state["param_groups"], root["param_groups"]):
        for key, value in root_group.items():
            assert type(mine_group[key]) is type(value) and mine_group[key] == value, key
    assert state["param_groups"][0]["lr"] == 0.01
    assert set(state["state"]) == set(root["state"])
    for k, entry in root["state"].items():
        for field, value in entry.items():
            got = state["state"][k][field]
            assert (torch.equal(got, value) if isinstance(value, torch.Tensor)
                    else got == value), (k, field)
    opt.free()


COPIES = ("pack", "gather", "unpack", "unpack_new")


def counting_copies(monkeypatch):
    """Count every call of the bucket buffers' copy paths; returns the counts."""
    from mpigrad._engine.buffers import BucketBuffers
    counts = dict.fromkeys(COPIES, 0)
    for name in COPIES:
        real = getattr(BucketBuffers, name)

        def counted(self, *args, _name=name, _real=real, **kwargs):
            counts[_name] += 1
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(BucketBuffers, name, counted)
    return counts


def test_a_step_copies_nothing_into_or_out_of_the_buckets(comm, monkeypatch):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(20)])
    opt = mgt.DistributedOptimizer(torch.optim.SGD(layers.parameters(), lr=0.1))
    counts = counting_copies(monkeypatch)
    x = torch.full((4, 32), float(comm.rank + 1))
    for _ in range(2):
        opt.zero_grad()
        layers(x).sum().backward()
        opt.step()
    assert counts == dict.fromkeys(COPIES, 0), f"bucket copies in a step: {counts}"
    assert_identical_across_ranks(comm, layers)
    opt.free()


def test_frozen_and_integer_parameters_are_left_out(comm):
    x, y = data(comm.size)
    model = Net()
    frozen = torch.nn.Linear(5, 2)
    frozen.requires_grad_(False)
    counter = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    params = list(model.parameters()) + list(frozen.parameters()) + [counter]
    opt = mgt.DistributedOptimizer(optimizer_for("sgd", params))
    for _ in range(STEPS):
        opt.zero_grad()
        loss_of(model, x[comm.rank::comm.size], y[comm.rank::comm.size]).backward()
        opt.step()
    assert frozen.weight.grad is None and counter.grad is None
    assert_identical_across_ranks(comm, model)
    assert max_deviation(model, one_rank_reference("sgd", torch.float32, comm.size)) < 1e-5
    frozen.requires_grad_(True)                  # unfrozen after wrapping: not reduced
    (model(x) + frozen(x)).sum().backward()
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[6\] has a gradient "
                                           r"but had requires_grad=False"):
        opt.step()
    opt.free()


def test_a_group_added_on_every_rank_is_reduced_from_the_next_step(comm):
    x, y = data(comm.size)
    mine = x[comm.rank::comm.size], y[comm.rank::comm.size]

    def train(model, opt, batch):
        for step in range(STEPS):
            if step == 1:
                opt.add_param_group({"params": list(model.unused.parameters()), "lr": 0.05})
            opt.zero_grad()
            loss_of(model, *batch, branch=True).backward()
            opt.step()

    model, reference = Net(), Net()
    train(model, mgt.DistributedOptimizer(torch.optim.SGD(model.body.parameters(), lr=0.1)), mine)
    train(reference, torch.optim.SGD(reference.body.parameters(), lr=0.1), (x, y))
    assert_identical_across_ranks(comm, model)
    deviation = max(float((a.detach() - b.detach()).abs().max())
                    for a, b in zip(model.parameters(), reference.parameters()))
    assert deviation < 1e-5


def test_a_group_added_on_one_rank_raises_everywhere(comm):
    from mpigrad import StructureMismatchError
    x, y = data(comm.size)
    model = Net()
    opt = mgt.DistributedOptimizer(torch.optim.SGD(model.body.parameters(), lr=0.1))
    if comm.rank == 0:
        opt.add_param_group({"params": list(model.unused.parameters())})
    opt.zero_grad()
    # bucket_views (node memory) against start, or 6 gradients against 4
    with pytest.raises((StructureMismatchError, ValueError),
                       match="expecting the same call on every rank|number of gradients differs"):
        loss_of(model, x, y, branch=True).backward()
    opt.free()


def test_one_backward_pass_too_many_on_one_rank_raises_everywhere(comm):
    from mpigrad import StructureMismatchError
    x, y = data(comm.size)
    model = Net()
    opt = mgt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   backward_passes_per_step=2)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3 if comm.rank == 0 else 2):
        (loss_of(model, x, y) / 2).backward()
    with pytest.raises(StructureMismatchError,
                       match=r"'backward passes in the step \(backward_passes_per_step=2\)' "
                             r"differs across ranks: rank 0 has 3, rank \d has 2"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)), "a step was taken"
    opt.zero_grad()                                  # the next step starts anew
    for _ in range(2):
        (loss_of(model, x[comm.rank::comm.size], y[comm.rank::comm.size]) / 2).backward()
    opt.step()
    assert_identical_across_ranks(comm, model)
    opt.free()


def test_an_extra_zero_grad_on_one_rank_raises_everywhere(comm):
    from mpigrad import StructureMismatchError
    x, y = data(comm.size)
    model = Net()
    opt = mgt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    failed = None
    for step in range(2):
        try:
            opt.zero_grad()
            loss_of(model, x, y).backward()
            if comm.rank == 0:
                opt.zero_grad()                      # finishes this step's reduction
            opt.step()                               # rank 0: reduces a second time
        except StructureMismatchError as exc:
            failed = step, str(exc)
            break
    assert failed is not None, "no error"
    assert failed[0] == (0 if comm.rank == 0 else 1)
    assert "'optimizer steps taken' differs across ranks: rank 0 has 0" in failed[1]
    opt.free()

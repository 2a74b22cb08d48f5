"""mpigrad.torch.ShardedOptimizer: N ranks with per-rank batch b train as 1
rank with batch N*b with torch's own optimizer (SGD with momentum, Adam,
AdamW, RMSprop, Adagrad; fp32 and half-precision parameters), bitwise
identical across ranks, state 1/N per rank; state_dict in torch's format,
resharded at another rank count; clipping by the global norm; errors on
every rank. Run under mpiexec -n 2 and -n 3 (and 4 as 2 nodes)."""

import pytest

torch = pytest.importorskip("torch")

import mpigrad.torch as mgt  # noqa: E402
from mpigrad import StructureMismatchError  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=2)

STEPS = 5
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def data(size, rows=12):
    g = torch.Generator().manual_seed(11)
    return torch.randn(rows * size, 7, generator=g), torch.randn(rows * size, 3, generator=g)


class Net(torch.nn.Module):
    """Parameters of sizes not divisible by 2 or 3, one smaller than the ranks."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(5)
        self.first = torch.nn.Linear(7, 5).to(dtype)
        self.second = torch.nn.Linear(5, 3).to(dtype)
        self.gain = torch.nn.Parameter(torch.ones((), dtype=dtype))

    def forward(self, x):
        return self.second(torch.tanh(self.first(x.to(self.gain.dtype)))) * self.gain


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y)


def my_rows(comm, x, y, size=None, rank=None):
    size = comm.size if size is None else size
    rank = comm.rank if rank is None else rank
    rows = x.shape[0] // size
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def train(opt, model, x, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()


def reference(name, size, steps=STEPS, dtype=torch.float32):
    """1 rank, the whole batch, the plain torch optimizer."""
    x, y = data(size)
    model = Net(dtype)
    opt = OPTIMIZERS[name](model.parameters())
    train(opt, model, x, y, steps)
    return model, opt


def assert_identical_across_ranks(comm, model):
    mine = [p.detach().float().numpy().tobytes() for p in model.parameters()]
    assert mine == comm.bcast(mine, root=0), "parameters differ across ranks (bitwise)"


def assert_close(model, ref, tolerance):
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        deviation = float((a.detach().float() - b.detach().float()).abs().max())
        assert deviation <= tolerance, f"{name}: {deviation} from the 1-rank run"


def state_numbers(opt):
    """Numbers of the optimizer's state held per element (not its step counts)."""
    return sum(v.numel() for s in opt.state.values() for k, v in s.items()
               if torch.is_tensor(v) and k != "step")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_trains_as_one_rank_with_the_whole_batch(comm, name):
    x, y = data(comm.size)
    model = Net()
    opt = mgt.ShardedOptimizer(OPTIMIZERS[name](model.parameters()))
    mine = my_rows(comm, x, y)
    train(opt, model, *mine, STEPS)
    ref, ref_opt = reference(name, comm.size)
    assert_close(model, ref, 1e-5)
    assert_identical_across_ranks(comm, model)
    # each rank holds state for its shard: the shards' state adds up to the whole
    total = comm.allreduce(state_numbers(opt))
    assert total == state_numbers(ref_opt)
    assert state_numbers(opt) <= state_numbers(ref_opt) // comm.size + 2 * 8
    opt.free()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_keep_a_float32_master(comm, dtype):
    x, y = data(comm.size)
    model = Net(dtype)
    opt = mgt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    train(opt, model, *my_rows(comm, x, y), STEPS)
    assert all(p.dtype == dtype for p in model.parameters())
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v))
    # the float32 master against a float32 run: one rounding to the half type
    ref = Net(torch.float32)
    ref.load_state_dict({k: v.float() for k, v in Net(dtype).state_dict().items()})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    # the half model's forward, the float32 update: the sharded run's recipe
    half = Net(dtype)
    xs, ys = data(comm.size)
    for _ in range(STEPS):
        half.zero_grad()
        loss_of(half, xs, ys).backward()
        ref_opt.zero_grad()
        for p, h in zip(ref.parameters(), half.parameters()):
            p.grad = h.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for p, h in zip(ref.parameters(), half.parameters()):
                h.copy_(p)
    tolerance = {torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    assert_close(model, half, tolerance)
    assert_identical_across_ranks(comm, model)
    opt.free()


def test_state_dict_is_torchs_and_reshards_at_another_rank_count(comm):
    """Train at N ranks, save, load at N - 1 ranks (a sub-communicator) and
    into a plain optimizer, go on: the 1-rank trajectory either way."""
    x, y = data(comm.size)
    model = Net()
    opt = mgt.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    train(opt, model, *my_rows(comm, x, y), 3)
    saved, params = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    ref, ref_opt = reference("adam", comm.size, steps=3)
    plain = ref_opt.state_dict()
    assert sorted(saved["state"]) == sorted(plain["state"])
    for number, values in plain["state"].items():
        for key, value in values.items():
            assert torch.allclose(saved["state"][number][key].float(), value.float(),
                                  rtol=1e-5, atol=1e-7), (number, key)
    assert saved["param_groups"] == plain["param_groups"]
    opt.free()

    # the 1-rank run going on
    train(ref_opt, ref, x, y, 2)
    # N - 1 ranks going on from the checkpoint, with the same whole batch
    sub = comm.Split(0 if comm.rank < comm.size - 1 else 1, comm.rank)
    if comm.rank < comm.size - 1:
        model2 = Net()
        model2.load_state_dict(params)
        opt2 = mgt.ShardedOptimizer(torch.optim.Adam(model2.parameters(), lr=0.5), comm=sub)
        opt2.load_state_dict(saved)
        assert opt2.param_groups[0]["lr"] == 0.01
        rows = my_rows(comm, x, y, size=sub.size, rank=sub.rank)
        train(opt2, model2, *rows, 2)
        assert_close(model2, ref, 1e-5)
        opt2.free()
    sub.Free()
    # a plain torch optimizer loads it too
    model3 = Net()
    model3.load_state_dict(params)
    opt3 = torch.optim.Adam(model3.parameters(), lr=0.01)
    opt3.load_state_dict(saved)
    train(opt3, model3, x, y, 2)
    assert_close(model3, ref, 1e-5)


def test_loads_a_plain_optimizers_state(comm):
    x, y = data(comm.size)
    ref, ref_opt = reference("sgd", comm.size, steps=2)
    model = Net()
    model.load_state_dict(ref.state_dict())
    opt = mgt.ShardedOptimizer(OPTIMIZERS["sgd"](model.parameters()))
    opt.load_state_dict(ref_opt.state_dict())
    train(opt, model, *my_rows(comm, x, y), 3)
    train(ref_opt, ref, x, y, 3)
    assert_close(model, ref, 1e-5)
    opt.free()


def test_parameters_changed_after_wrapping_are_taken(comm):
    """A broadcast (or a load) after wrapping is what the step starts from."""
    x, y = data(comm.size)
    model = Net()
    opt = mgt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(comm.rank + 1)             # ranks differ...
    mgt.broadcast_parameters(model.state_dict(), root=0)   # ...until the broadcast
    train(opt, model, *my_rows(comm, x, y), 2)
    ref, _ = reference("sgd", comm.size, steps=0)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    train(ref_opt, ref, x, y, 2)
    assert_close(model, ref, 1e-5)
    opt.free()


def test_clipping_by_the_global_norm(comm):
    x, y = data(comm.size)
    model = Net()
    opt = mgt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref, _ = reference("sgd", comm.size, steps=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss_of(model, *my_rows(comm, x, y)).backward()
        norm = opt.clip_grad_norm_(0.05)
        with opt.skip_synchronize():
            opt.step()
        ref_opt.zero_grad()
        loss_of(ref, x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        assert abs(float(norm) - float(ref_norm)) <= 1e-5 * float(ref_norm)
    assert_close(model, ref, 1e-5)
    opt.free()


def test_unused_parameters_count_as_zero(comm):
    x, y = data(comm.size)
    model = Net()
    opt = mgt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.zero_grad()
    if comm.rank == 0:                   # the others have no gradients at all
        loss_of(model, *my_rows(comm, x, y)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    ref = Net()
    loss = loss_of(ref, *my_rows(comm, x, y, rank=0)) / comm.size
    loss.backward()
    for p, b, r in zip(model.parameters(), before, ref.parameters()):
        assert torch.allclose(p.detach(), b - 0.1 * r.grad, rtol=1e-5, atol=1e-7)
    assert_identical_across_ranks(comm, model)
    opt.free()


def test_a_skipped_step_on_one_rank_raises_everywhere(comm):
    """Rank 0 reduces but does not step (a local decision): its next
    reduce-scatter meets the others' allgather, and every rank raises."""
    x, y = data(comm.size)
    model = Net()
    opt = mgt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    train(opt, model, *my_rows(comm, x, y), 1)
    with pytest.raises(StructureMismatchError):
        for attempt in range(2):
            opt.zero_grad()
            loss_of(model, *my_rows(comm, x, y)).backward()
            if comm.rank == 0 and attempt == 0:
                opt.synchronize()
                continue
            opt.step()
    opt.free()


def test_different_models_raise_everywhere(comm):
    model = Net() if comm.rank else torch.nn.Linear(7, 3)
    opt = mgt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        with pytest.raises(StructureMismatchError):
            model(torch.ones(2, 7)).sum().backward()
            opt.step()
    finally:
        opt.free()


def test_device_parameters_are_refused():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = torch.nn.Linear(3, 2).cuda()
    with pytest.raises(TypeError, match="CPU parameters"):
        mgt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_parameters(comm, dtype):
    """A transposed parameter (its elements are not contiguous: stepped in a
    copy, written back element by element) beside a contiguous one."""
    def make():
        torch.manual_seed(2)
        return [torch.nn.Parameter(torch.randn(3, 7).to(dtype).t()),
                torch.nn.Parameter(torch.randn(3).to(dtype))]

    def loss(params, x, y):
        return torch.nn.functional.mse_loss((x.to(dtype) @ params[0] + params[1]).float(), y)

    x, y = data(comm.size)
    params, ref = make(), make()
    assert not params[0].is_contiguous()
    opt = mgt.ShardedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        loss(params, *my_rows(comm, x, y)).backward()
        opt.step()
        ref_opt.zero_grad()
        loss(ref, x, y).backward()
        ref_opt.step()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for p, r in zip(params, ref):
        assert float((p.detach().float() - r.detach().float()).abs().max()) <= tolerance
    mine = [p.detach().float().numpy().tobytes() for p in params]
    assert mine == comm.bcast(mine, root=0)
    opt.free()


def test_without_overlap_several_backward_passes_accumulate(comm):
    """overlap=False: gradients reduce-scattered in step(), after two passes
    over halves of the rows (the loss halved) -- the same step as one pass."""
    x, y = data(comm.size)
    model = Net()
    opt = mgt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               overlap=False)
    xs, ys = my_rows(comm, x, y)
    half = xs.shape[0] // 2
    for _ in range(STEPS):
        opt.zero_grad()
        (loss_of(model, xs[:half], ys[:half]) / 2).backward()
        (loss_of(model, xs[half:], ys[half:]) / 2).backward()
        opt.step()
    ref, _ = reference("sgd", comm.size)
    assert_close(model, ref, 1e-5)
    assert_identical_across_ranks(comm, model)
    opt.free()


def test_with_overlap_a_second_backward_pass_raises(comm):
    x, y = data(comm.size)
    model = Net()
    opt = mgt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    xs, ys = my_rows(comm, x, y)
    loss_of(model, xs, ys).backward()
    with pytest.raises(RuntimeError, match="overlap=False"):
        loss_of(model, xs, ys).backward()
    opt.zero_grad()                       # finishes the reduce-scatter begun: every rank alike
    train(opt, model, xs, ys, 1)          # and the next step works
    assert_identical_across_ranks(comm, model)
    opt.free()


def test_grad_scaler_skips_an_overflowing_step_on_every_rank(comm):
    """fp16 autocast and GradScaler: an inf in one rank's gradient of the last
    bias (one element: in one rank's shard only); every rank skips that step
    (and only that one), the scale is the same everywhere, the parameters
    stay identical."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = mgt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    g = torch.Generator().manual_seed(comm.rank)
    skipped = []
    for step in range(5):
        x = torch.randn(32, 16, generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        if step == 2 and comm.rank == 0:            # d loss / d bias = inf
            loss = loss + model[2].bias.sum() * float("inf")
        scaler.scale(loss.float()).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        opt.clip_grad_norm_(1.0)
        before = [p.detach().clone() for p in model.parameters()]
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(a, b) for a, b in zip(model.parameters(), before)))
    assert skipped == [False, False, True, False, False]
    assert comm.allgather(scaler.get_scale()) == [scaler.get_scale()] * comm.size
    assert_identical_across_ranks(comm, model)
    opt.free()


# -- a bad state or a failed step on one rank raises on every rank ----------------

def trained(comm, steps=2):
    x, y = data(comm.size)
    model = Net()
    opt = mgt.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), timeout=30)
    train(opt, model, *my_rows(comm, x, y), steps)
    return model, opt, (x, y)


def on_last(comm, mine, theirs):
    return mine if comm.rank == comm.size - 1 else theirs


@pytest.mark.parametrize("case, error, match", [
    ("truncated exp_avg", ValueError, r"the state 'exp_avg' of parameter 1: expecting one "
                                      r"value per element, shape \(5, 7\), got \(34,\)"),
    ("a step count of 1000", StructureMismatchError,
     r"'state_dict step' differs across ranks: rank 0 has \(2.0,\), rank \d has \(1000.0,\)"),
    ("a parameter group short", ValueError, r"expecting parameter groups of sizes \[5\]"),
])
def test_a_bad_loaded_state_on_one_rank_raises_on_every_rank(comm, case, error, match):
    import copy
    from mpigrad import PeerError
    model, opt, (x, y) = trained(comm)
    saved = copy.deepcopy(opt.state_dict())
    if comm.rank == comm.size - 1:
        if case == "truncated exp_avg":
            saved["state"][1]["exp_avg"] = saved["state"][1]["exp_avg"].reshape(-1)[:-1]
        elif case == "a step count of 1000":
            for values in saved["state"].values():
                values["step"] = torch.tensor(1000.0)
        else:
            saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][:-1]
    expected = error if error is StructureMismatchError else on_last(comm, error, PeerError)
    with pytest.raises(expected, match=match):
        opt.load_state_dict(saved)
    train(opt, model, *my_rows(comm, x, y), 1)        # the ranks go on in step, alike
    assert_identical_across_ranks(comm, model)
    opt.free()


def test_a_failure_inside_the_step_on_one_rank_raises_everywhere(comm, monkeypatch):
    from mpigrad import PeerError
    model, opt, (x, y) = trained(comm)
    if comm.rank == comm.size - 1:
        def broken(self, closure=None):
            raise RuntimeError("the optimizer's own step failed")
        monkeypatch.setattr(torch.optim.Adam, "step", broken)
    opt.zero_grad()
    loss_of(model, *my_rows(comm, x, y)).backward()
    with pytest.raises(on_last(comm, RuntimeError, PeerError),
                       match="the optimizer's own step failed"):
        opt.step()
    assert_identical_across_ranks(comm, model)        # the shards gathered as left
    monkeypatch.undo()
    train(opt, model, *my_rows(comm, x, y), 1)
    assert_identical_across_ranks(comm, model)
    opt.free()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no overlap"])
def test_a_parameter_reshaped_on_one_rank_raises_on_every_rank(comm, overlap):
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.w = torch.nn.Parameter(torch.randn(3, 4))

        def forward(self, x):
            return x @ self.w.reshape(3, 4).t()
    model = Flat()
    opt = mgt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap,
                               timeout=30)
    if comm.rank == comm.size - 1:
        model.w.data = model.w.data.reshape(12)
    opt.zero_grad()
    with pytest.raises(StructureMismatchError, match="'parameter shapes' differs across ranks"):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    opt.free()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no overlap"])
def test_an_extra_zero_grad_before_step_steps_on_zero_gradients_alike(comm, overlap):
    """zero_grad between backward and step discards the gradients, as torch's
    does, with and without overlap: the step sees zeros on every rank."""
    x, y = data(comm.size)
    model = Net()
    opt = mgt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap)
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, *my_rows(comm, x, y)).backward()
    opt.zero_grad()
    opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    train(opt, model, *my_rows(comm, x, y), 1)
    assert_identical_across_ranks(comm, model)
    opt.free()

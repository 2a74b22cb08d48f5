"""mpigrad.horovod.torch, Horovod's torch API on mpigrad: every collective
against a numpy reference computed from the rank count, async handles,
grouped calls, alltoall splits, reducescatter's uneven rows, join with
uneven batches, process sets of even and odd ranks, gradients, and errors
on every rank. Run under mpiexec -n 2 and -n 3."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpigrad.horovod.torch as hvd  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=2)

DTYPES = [torch.int32, torch.int64, torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()


def values(rank, shape=(4, 3), dtype=torch.float32, seed=0):
    """Small integers depending on rank: exact in every dtype and in sums."""
    n = int(np.prod(shape))
    base = (np.arange(n) * (seed + 1) + 3 * rank + seed) % 11 - 5
    return torch.tensor(base.reshape(shape), dtype=torch.float64).to(dtype)


def every_rank(shape=(4, 3), dtype=torch.float32, seed=0):
    return [values(r, shape, dtype, seed).double() for r in range(hvd.size())]


def test_the_job():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    assert (hvd.rank(), hvd.size()) == (comm.rank, comm.size)
    assert hvd.is_initialized() and hvd.mpi_enabled() and hvd.mpi_built()
    assert not hvd.gloo_enabled() and hvd.nccl_built() == 0
    assert 0 <= hvd.local_rank() < hvd.local_size() <= hvd.size()
    assert hvd.cross_size() * hvd.local_size() == hvd.size()


@pytest.mark.parametrize("mark_cycles", [False, True])
def test_timeline_is_a_chrome_trace_written_by_rank_0(tmp_path, mark_cycles):
    import json
    path = hvd.broadcast_object(str(tmp_path / "timeline.json"), root_rank=0)
    hvd.start_timeline(path, mark_cycles=mark_cycles)
    hvd.allreduce(torch.ones(3), name="test_allreduce")
    hvd.synchronize(hvd.allgather_async(torch.ones(2)))
    hvd.stop_timeline()
    hvd.barrier()
    if hvd.rank() == 0:
        with open(path) as f:
            text = f.read()
        events = json.loads(text)
        rows = {e["args"]["name"]: e["pid"] for e in events if e.get("name") == "process_name"}
        assert "allreduce.test_allreduce" in rows and any(
            name.startswith("allgather.noname.") for name in rows), rows
        row = rows["allreduce.test_allreduce"]
        phases = [(e["ph"], e.get("name")) for e in events if e.get("pid") == row
                  and e["ph"] in "BE"]
        assert phases == [("B", "NEGOTIATE_ALLREDUCE"), ("E", None), ("B", "ALLREDUCE"),
                          ("E", None)], phases
        assert "start_time_since_epoch_in_micros" in text
        assert ("CYCLE_START" in text) == mark_cycles


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["Sum", "Average", "Min", "Max", "Product"])
def test_allreduce_ops_against_numpy(dtype, op):
    parts = every_rank(dtype=dtype)
    want = {"Sum": sum(parts), "Average": sum(parts) / hvd.size(),
            "Min": torch.stack(parts).min(0).values, "Max": torch.stack(parts).max(0).values,
            "Product": torch.stack(parts).prod(0)}[op]
    if op == "Average" and not dtype.is_floating_point:
        want = torch.trunc(want)                # divided, then cast: Horovod's
    mine = values(hvd.rank(), dtype=dtype)
    got = hvd.allreduce(mine, op=getattr(hvd, op))
    assert got.dtype == dtype and torch.equal(mine, values(hvd.rank(), dtype=dtype))
    assert torch.allclose(got.double(), want.to(dtype).double(), rtol=1e-2 if dtype in (
        torch.float16, torch.bfloat16) else 0, atol=0)
    same = hvd.allgather_object(got.double().numpy().tobytes())
    assert all(s == same[0] for s in same), "results differ across ranks"


def test_average_flag_inplace_and_scaling():
    mine = values(hvd.rank())
    total = sum(every_rank())
    assert torch.equal(hvd.allreduce(mine, average=False).double(), total)
    out = hvd.allreduce_(mine, average=False, prescale_factor=0.5, postscale_factor=4.0)
    assert out is mine and torch.equal(mine.double(), total * 2)
    with pytest.raises(ValueError, match="mutually exclusive"):
        hvd.allreduce(mine, average=True, op=hvd.Sum)
    ints = torch.full((3,), 10, dtype=torch.int32)
    # Horovod: integers scaled in float64, truncated
    assert hvd.allreduce(ints, op=hvd.Sum, prescale_factor=0.55).tolist() == [5 * hvd.size()] * 3


def test_async_handles_and_grouped_calls():
    handles = [hvd.allreduce_async(values(hvd.rank(), seed=k), op=hvd.Sum, name=f"t{k}")
               for k in range(5)]
    assert all(isinstance(hvd.poll(h), bool) for h in handles)
    for k, h in enumerate(handles):
        assert torch.equal(hvd.synchronize(h).double(), sum(every_rank(seed=k)))
    with pytest.raises(ValueError, match="not an outstanding"):
        hvd.synchronize(handles[0])
    mixed = [values(hvd.rank(), (2, 5), torch.float32), values(hvd.rank(), (7,), torch.int64),
             values(hvd.rank(), (3,), torch.float16)]
    out = hvd.grouped_allreduce(mixed, op=hvd.Sum)
    for o, m, shape in zip(out, mixed, [(2, 5), (7,), (3,)]):
        assert o.dtype == m.dtype and torch.equal(o.double(), sum(every_rank(shape, m.dtype)))
    hvd.grouped_allreduce_(mixed, op=hvd.Max)
    assert torch.equal(mixed[1].double(), torch.stack(every_rank((7,), torch.int64)).max(0).values)


def test_duplicate_names_in_flight_raise_and_are_per_kind():
    h = hvd.allreduce_async(torch.ones(3), name="dup")
    with pytest.raises(ValueError, match="already in flight"):
        hvd.allreduce_async(torch.ones(3), name="dup")
    g = hvd.allgather_async(torch.ones(2), name="dup")          # another kind: allowed
    hvd.synchronize(h)
    hvd.synchronize(g)
    hvd.synchronize(hvd.allreduce_async(torch.ones(3), name="dup"))   # free again


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.float16,
                                   torch.bfloat16, torch.float64, torch.bool], ids=str)
def test_allgather_with_first_dimensions_that_differ(dtype):
    rows = [r + 1 for r in range(hvd.size())]
    mine = torch.full((rows[hvd.rank()], 3), hvd.rank() % 2 if dtype == torch.bool
                      else hvd.rank()).to(dtype)
    got = hvd.allgather(mine)
    assert got.shape == (sum(rows), 3) and got.dtype == dtype
    start = 0
    for r, n in enumerate(rows):
        assert (got[start:start + n].double() == (r % 2 if dtype == torch.bool else r)).all()
        start += n
    out = hvd.synchronize(hvd.allgather_async(mine))
    assert torch.equal(out, got)


def test_broadcast_from_every_root():
    for root in range(hvd.size()):
        mine = values(hvd.rank(), dtype=torch.float16)
        got = hvd.broadcast(mine, root)
        assert torch.equal(got, values(root, dtype=torch.float16))
        assert torch.equal(mine, values(hvd.rank(), dtype=torch.float16))   # not written
        hvd.broadcast_(mine, root)
        assert torch.equal(mine, got)


def test_alltoall_with_splits_returns_the_received_splits():
    size, rank = hvd.size(), hvd.rank()
    # rank r sends r + 1 rows (valued 100 r + destination) to every rank
    rows = torch.tensor([[100 * rank + d] * 2 for d in range(size) for _ in range(rank + 1)],
                        dtype=torch.float32)
    splits = torch.tensor([rank + 1] * size, dtype=torch.int32)
    got, received = hvd.alltoall(rows, splits)
    assert received.tolist() == [r + 1 for r in range(size)]
    want = [100 * r + rank for r in range(size) for _ in range(r + 1)]
    assert got[:, 0].tolist() == want
    equal = hvd.alltoall(torch.arange(2 * size, dtype=torch.float32) + 10 * rank)
    assert equal.tolist() == [10 * r + 2 * rank + k for r in range(size) for k in range(2)]
    with pytest.raises(ValueError, match="integer splits"):
        hvd.alltoall(rows, splits.float())
    with pytest.raises(ValueError, match="divisible"):
        hvd.alltoall(torch.ones(size + 1))


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter_gives_uneven_rows_to_the_first_ranks(op):
    size, rank = hvd.size(), hvd.rank()
    n = 2 * size + 1
    total = sum(every_rank((n, 2), torch.float64))
    if op == "Average":
        total = total / size
    rows = [n // size + (1 if r < n % size else 0) for r in range(size)]
    start = sum(rows[:rank])
    got = hvd.reducescatter(values(rank, (n, 2), torch.float64), op=getattr(hvd, op))
    assert torch.equal(got, total[start:start + rows[rank]])
    pair = hvd.grouped_reducescatter([values(rank, (n, 2), torch.float64),
                                      values(rank, (size,), torch.float64)], op=hvd.Sum)
    assert torch.equal(pair[1], sum(every_rank((size,), torch.float64))[rank:rank + 1])


def test_reducescatter_with_fewer_rows_than_ranks_and_its_errors():
    """A rank whose share is no row gets an empty tensor (at 3 ranks, 2 rows;
    its gradient too); float16 sums in float32, rounded once; Adasum is
    Horovod's own error (a RuntimeError) on every rank."""
    size, rank = hvd.size(), hvd.rank()
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    out = hvd.reducescatter(x, op=hvd.Average)
    mine = 1 if rank < 2 else 0             # Horovod's split of 2 rows
    assert out.shape == (mine, 3)
    assert torch.equal(out, torch.full((mine, 3), sum(r + 1 for r in range(size)) / size))
    out.sum().backward()
    assert x.grad.shape == (2, 3)
    halves = torch.arange(4 * 5, dtype=torch.float32).reshape(4, 5) * (rank + 1) / 7
    got = hvd.reducescatter(halves.half(), op=hvd.Sum)
    total = sum((torch.arange(4 * 5, dtype=torch.float32).reshape(4, 5) * (r + 1) / 7).half()
                .float() for r in range(size))
    rows = [4 // size + (1 if r < 4 % size else 0) for r in range(size)]
    start = sum(rows[:rank])
    assert got.dtype == torch.float16
    assert torch.equal(got, total[start:start + rows[rank]].half())
    with pytest.raises(hvd.HorovodInternalError, match="Adasum"):
        hvd.reducescatter(torch.ones(size, 2), op=hvd.Adasum)


def test_gradients_as_horovod_defines_them():
    """Horovod 0.28's gradients: allreduce's is the allreduce of the
    gradients (same op); allgather's the average of the ranks' gradients,
    this rank's rows; broadcast's the average on the root (a rank of the
    job), zeros elsewhere; alltoall's the alltoall back; reducescatter's the
    allgather of the gradients, times the set's size for a sum."""
    size, rank = hvd.size(), hvd.rank()
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    assert x.grad.tolist() == [size] * 3
    # grouped: recorded where one tensor requires grad
    constant, x = torch.ones(2), torch.ones(3, requires_grad=True)
    outs = hvd.grouped_allreduce([constant, x], op=hvd.Sum)
    assert [o.requires_grad for o in outs] == [True, True]
    (outs[1] * (rank + 1)).sum().backward()
    assert x.grad.tolist() == [sum(range(1, size + 1))] * 3
    x = torch.full((rank + 1, 2), float(rank), requires_grad=True)
    gathered = hvd.allgather(x)
    # every rank sends the gradient r * (rank + 1) for rank r's rows, plus its own rank
    grads = torch.cat([torch.full((r + 1, 2), float(r * (r + 1))) for r in range(size)])
    gathered.backward(grads + rank)
    mean_of_ranks = sum(range(size)) / size
    assert torch.allclose(x.grad, torch.full_like(x, rank * (rank + 1) + mean_of_ranks))
    for root in range(size):
        x = torch.ones(3, requires_grad=True)
        (hvd.broadcast(x, root) * (rank + 1)).sum().backward()
        want = sum(r + 1 for r in range(size)) / size if rank == root else 0
        assert torch.allclose(x.grad, torch.full((3,), float(want)))
    x = torch.ones(size * 2, requires_grad=True)
    out = hvd.alltoall(x)
    out.sum().backward()
    assert (x.grad == 1).all()
    for op, factor in ((hvd.Sum, size), (hvd.Average, 1)):
        x = torch.ones(size + 1, 2, requires_grad=True)   # rank 0 keeps two rows
        out = hvd.reducescatter(x, op=op)
        (out * (rank + 1)).sum().backward()
        rows = torch.cat([torch.full((2 if r == 0 else 1, 2), float(r + 1))
                          for r in range(size)])
        assert torch.allclose(x.grad, rows * factor)
    pair = [torch.ones(size, 2, requires_grad=True), torch.ones(size, requires_grad=True)]
    outs = hvd.grouped_reducescatter(pair, op=hvd.Sum, prescale_factor=0.5)
    sum(o.sum() for o in outs).backward()
    assert all(torch.allclose(p.grad, torch.full_like(p, 0.5 * size)) for p in pair)


def sparse_rows(rank, dtype=torch.float32):
    """A sparse 6 x 2 tensor of rank's rows: {rank, rank + 1, rank + 1} (a duplicate)."""
    rows = torch.tensor([[rank % 6, (rank + 1) % 6, (rank + 1) % 6]])
    return torch.sparse_coo_tensor(rows, torch.full((3, 2), float(rank + 1)).to(dtype), (6, 2),
                                   check_invariants=True)


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_sparse_allreduce_gathers_every_ranks_rows(op):
    size, rank = hvd.size(), hvd.rank()
    dense = sum(sparse_rows(r).to_dense() for r in range(size))
    want = dense / size if op == "Average" else dense
    # Horovod's sparse_allreduce_async gives a function that waits
    got = hvd.sparse_allreduce_async(sparse_rows(rank), name="emb", op=getattr(hvd, op))()
    # each rank's values averaged, then added up as sparse tensors add
    assert got.layout == torch.sparse_coo and torch.allclose(got.to_dense(), want)
    got = hvd.synchronize(hvd.allreduce_async(sparse_rows(rank), op=getattr(hvd, op)))
    assert got.is_sparse and torch.allclose(got.to_dense(), want)
    with pytest.raises(TypeError, match="dense tensors"):
        hvd.allreduce_(sparse_rows(rank))


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_distributed_optimizer_reduces_sparse_gradients_as_sparse(sparse_as_dense):
    """nn.Embedding(sparse=True) with SparseAdam (which takes sparse
    gradients only): every rank's rows averaged, still sparse; with
    sparse_as_dense, averaged dense and sparse again for the step (as
    Horovod's)."""
    size, rank = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 3, sparse=True), torch.nn.Linear(3, 1))
    inner = torch.optim.SparseAdam(model[0].parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model[0].named_parameters(),
                                   sparse_as_dense=sparse_as_dense)

    def batch(r, step):
        return torch.tensor([(r + step) % 8, (2 * r + 1) % 8, (r + step) % 8])
    for step in range(3):
        model.zero_grad()
        opt.zero_grad()
        model(batch(rank, step)).sum().backward()
        opt.synchronize()
        grad = model[0].weight.grad
        assert grad.is_sparse
        want = torch.zeros(8, 3)
        for r in range(size):
            reference = torch.zeros(8, 3)
            reference.index_add_(0, batch(r, step), model[1].weight.detach().expand(3, 3))
            want += reference / size
        assert torch.allclose(grad.to_dense(), want, atol=1e-6), (grad.to_dense(), want)
        with opt.skip_synchronize():
            opt.step()
    same = hvd.allgather_object(model[0].weight.detach().numpy().tobytes())
    assert all(s == same[0] for s in same)
    opt.free()


def adasum_reference(vectors, sizes):
    """Adasum's binary tree over the ranks' flat vectors, serially (float64)."""
    bounds = np.cumsum([0, *sizes])
    while len(vectors) > 1:
        pairs = []
        for a, b in zip(vectors[::2], vectors[1::2]):
            out = np.empty_like(a)
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                x, y = a[lo:hi], b[lo:hi]
                dot = x @ y
                ca = 1 - dot / (2 * (x @ x)) if x @ x >= 1e-8 else 1.0
                cb = 1 - dot / (2 * (y @ y)) if y @ y >= 1e-8 else 1.0
                out[lo:hi] = ca * x + cb * y
            pairs.append(out)
        vectors = pairs
    return vectors[0]


def test_adasum_against_the_formula_computed_serially():
    """Horovod's adaptive summation: tensor by tensor, a binary tree of
    pairs; a power-of-two number of ranks and the global set only."""
    size, rank = hvd.size(), hvd.rank()
    shapes = [(5, 3), (7,), (1,), (0,)]

    def tensors(r):
        g = np.random.default_rng(r)
        made = [g.standard_normal(s) for s in shapes]
        made[2][:] = 0.0                      # a zero gradient: its coefficient is 1
        return made
    mine = [torch.tensor(t) for t in tensors(rank)]
    if size & (size - 1):
        with pytest.raises(NotImplementedError, match="power-of-two"):
            hvd.grouped_allreduce(mine, op=hvd.Adasum)
        return
    got = hvd.grouped_allreduce(mine, op=hvd.Adasum)
    sizes = [int(np.prod(s)) for s in shapes]
    want = adasum_reference([np.concatenate([t.reshape(-1) for t in tensors(r)])
                             for r in range(size)], sizes)
    flat = np.concatenate([g.numpy().reshape(-1) for g in got])
    assert np.allclose(flat, want, rtol=1e-12, atol=1e-12)
    same = hvd.allgather_object(flat.tobytes())
    assert all(s == same[0] for s in same), "results differ across ranks"
    # float32, scaled; identical vectors: Adasum(a, a) = a
    x = torch.full((4,), 3.0)
    assert torch.allclose(hvd.allreduce(x, op=hvd.Adasum, postscale_factor=2.0), 2 * x)
    with pytest.raises(TypeError, match="floating point"):
        hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum)
    everyone = hvd.add_process_set(range(size))
    with pytest.raises(NotImplementedError, match="global process set"):
        hvd.allreduce(x, op=hvd.Adasum, process_set=everyone)
    hvd.remove_process_set(everyone)
    # a joined rank takes part with zeros, which leave the others' Adasum as it is
    if rank == 0:
        hvd.join()
    else:
        mine = torch.tensor(tensors(rank)[0])
        others = [np.asarray(tensors(r)[0]).reshape(-1) for r in range(size)]
        others[0] = np.zeros_like(others[0])
        got = hvd.allreduce(mine, op=hvd.Adasum)
        assert np.allclose(got.numpy().reshape(-1), adasum_reference(others, [others[0].size]))
        hvd.join()


def test_adasum_distributed_optimizer_combines_the_local_steps_deltas():
    """DistributedOptimizer(op=hvd.Adasum): each rank steps on its own
    gradients; every rank ends at the start plus the Adasum of the deltas."""
    size, rank = hvd.size(), hvd.rank()
    lr = 0.1

    def model_and_grads(r):
        torch.manual_seed(0)                        # the same start everywhere
        model = torch.nn.Linear(3, 2).double()
        x = torch.from_numpy(np.random.default_rng(r).standard_normal((4, 3)))
        model(x).pow(2).sum().backward()
        return model
    model = model_and_grads(rank)
    start = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    if size & (size - 1):
        with pytest.raises(NotImplementedError, match="power-of-two"):
            opt.step()
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
        return
    opt.step()
    deltas = [np.concatenate([(-lr * p.grad).reshape(-1).numpy()
                              for p in model_and_grads(r).parameters()]) for r in range(size)]
    want = np.concatenate([s.reshape(-1).numpy() for s in start]) + adasum_reference(
        deltas, [p.numel() for p in model.parameters()])
    got = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)
    same = hvd.allgather_object(got.tobytes())
    assert all(s == same[0] for s in same), "parameters differ across ranks"


def test_join_with_uneven_batches():
    """Rank 0 runs out of data after 1 batch; the others do 3 allreduces:
    rank 0 takes part with zeros; the average is still over every rank
    (mpigrad's one mean: the sum times 1/size in float32)."""
    size, rank = hvd.size(), hvd.rank()
    batches = 1 if rank == 0 else 3
    for _ in range(batches):
        got = hvd.allreduce(torch.full((4,), float(rank + 1)))
    last = hvd.join()
    assert last != 0 or size == 1
    if rank != 0:
        want = torch.full((4,), float(sum(r + 1 for r in range(1, size)))) \
            * torch.tensor(1 / size, dtype=torch.float32)
        assert torch.equal(got, want)
    # a rank that joined makes an allgather raise on the others
    if rank == 0:
        hvd.join()
    else:
        with pytest.raises(RuntimeError, match="joined"):
            hvd.allgather(torch.ones(2))
        hvd.join()


def test_horovod_run_calls_the_function_on_every_rank_of_this_job():
    """``import horovod`` scripts: ``horovod.run`` runs the function here and
    gives the results in rank order; a different np names the mpiexec line."""
    import mpigrad.horovod as horovod
    size = hvd.size()
    out = horovod.run(lambda a, b=0: a * (hvd.rank() + 1) + b, args=(2,), kwargs={"b": 1},
                      np=size, hosts="localhost:4", use_gloo=False, verbose=2)
    assert out == [2 * (r + 1) + 1 for r in range(size)]
    with pytest.raises(RuntimeError, match=f"got np={size + 1}: .*`mpiexec -n {size + 1} "):
        horovod.run(lambda: None, np=size + 1)


def test_objects():
    obj = {"rank": hvd.rank(), "list": list(range(hvd.rank()))}
    assert hvd.broadcast_object(obj, root_rank=hvd.size() - 1) == \
        {"rank": hvd.size() - 1, "list": list(range(hvd.size() - 1))}
    assert hvd.allgather_object(obj) == [{"rank": r, "list": list(range(r))}
                                         for r in range(hvd.size())]


def test_process_sets_of_even_and_odd_ranks():
    even = hvd.add_process_set(range(0, hvd.size(), 2))
    odd = hvd.add_process_set(hvd.ProcessSet(range(1, hvd.size(), 2)))
    mine = even if hvd.rank() % 2 == 0 else odd
    members = mine.ranks
    assert mine.included() and mine.size() == len(members)
    got = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, process_set=mine)
    assert got.item() == sum(members)
    other = odd if mine is even else even
    with pytest.raises(ValueError, match="not in"):
        hvd.allreduce(torch.ones(1), process_set=other)
    assert hvd.remove_process_set(even) and hvd.remove_process_set(odd)
    assert not hvd.remove_process_set(hvd.global_process_set)


def test_an_optimizer_of_the_even_ranks_steps_alone_on_the_odd_ones():
    """Horovod's: an optimizer of a process set reduces over the set; a rank
    outside it steps on its own gradients."""
    even = hvd.add_process_set(range(0, hvd.size(), 2))
    odd = hvd.add_process_set(range(1, hvd.size(), 2))
    weight = torch.nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([weight], lr=1.0),
                                   named_parameters=[("w", weight)], op=hvd.Sum,
                                   process_set=even)
    (weight * (hvd.rank() + 1.0)).sum().backward()
    opt.step()
    if hvd.rank() % 2 == 0:
        expected = -sum(r + 1.0 for r in even.ranks)
    else:
        expected = -(hvd.rank() + 1.0)
    assert torch.equal(weight.detach(), torch.full((3,), expected))
    assert hvd.remove_process_set(even) and hvd.remove_process_set(odd)


@pytest.mark.parametrize("sets", ["all", "even and odd"])
def test_broadcasts_within_a_process_set_take_roots_as_ranks_of_the_job(sets):
    if sets == "all":
        made = [hvd.add_process_set(range(hvd.size()))]
    else:
        made = [hvd.add_process_set(range(0, hvd.size(), 2)),
                hvd.add_process_set(range(1, hvd.size(), 2))]
    mine = made[hvd.rank() % len(made)]
    root = mine.ranks[-1]                        # a rank of the job: the set's last
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(hvd.rank())
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (hvd.rank() + 1), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root, process_set=mine)
    hvd.broadcast_optimizer_state(opt, root_rank=root, process_set=mine)
    assert torch.equal(model.weight, torch.full((2, 3), float(root)))
    assert opt.param_groups[0]["lr"] == 0.1 * (root + 1)
    assert hvd.broadcast_object(hvd.rank(), root_rank=root, process_set=mine) == root
    x = torch.full((2,), float(hvd.rank()), requires_grad=True)
    assert torch.equal(hvd.broadcast(x, root, process_set=mine), torch.full((2,), float(root)))
    hvd.broadcast_(x.detach(), root, process_set=mine)
    assert torch.equal(x.detach(), torch.full((2,), float(root)))
    assert all(s.size() == len(s.ranks) for s in made)      # on members and others alike
    outsider = next((r for r in range(hvd.size()) if r not in mine.ranks), hvd.size())
    with pytest.raises(ValueError, match="root_rank to be a rank of the job"):
        hvd.broadcast_object(0, root_rank=outsider, process_set=mine)
    assert all(hvd.remove_process_set(s) for s in made)


def test_mismatches_raise_on_every_rank():
    rank = hvd.rank()
    with pytest.raises(RuntimeError, match="differs across ranks"):
        hvd.allreduce(torch.ones(3 + rank))
    with pytest.raises(RuntimeError, match="differs"):
        hvd.allreduce(torch.ones(3, dtype=torch.int32 if rank else torch.float32))
    with pytest.raises(RuntimeError, match="differs"):
        hvd.broadcast(torch.ones(3), root_rank=rank)
    with pytest.raises(RuntimeError, match="'Horovod op' differs"):
        hvd.allreduce(torch.ones(3), op=hvd.Sum if rank else hvd.Max)
    # every rank goes on in step
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2


def wire_sum(per_rank, half):
    """Each rank's float32 values rounded once to ``half``, summed in float32 in rank order,
    the sum rounded once: what the wire gives."""
    total = per_rank[0].astype(half).astype(np.float32)
    for values in per_rank[1:]:
        total = total + values.astype(half).astype(np.float32)
    spread = np.float32(1 << (len(per_rank) - 1).bit_length())   # exact scaling
    return (total / spread).astype(half).astype(np.float32) * spread


@pytest.mark.parametrize("name, half", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_the_compressors_cast_as_horovods_do(name, half):
    """compress: a floating-point tensor cast to the half dtype, its dtype the
    ctx; decompress: cast back; integers as they are (Horovod's API, whatever
    mpigrad's calls send)."""
    compression = getattr(hvd.Compression, name)
    for dtype in (torch.float32, torch.float64):
        t = torch.ones(5, 5, 5, dtype=dtype)
        compressed, ctx = compression.compress(t)
        assert compressed.dtype == half
        back = compression.decompress(compressed, ctx)
        assert back.dtype == dtype and torch.equal(back, t)
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        t = torch.ones(5, dtype=dtype)
        compressed, ctx = compression.compress(t)
        assert compressed.dtype == dtype and compression.decompress(compressed, ctx).dtype == dtype


def test_an_average_past_float16s_range_whose_mean_fits_stays_finite():
    """Compression.fp16: 40000 on every rank sums past 65504, its average does not."""
    t = torch.full((70_000,), 40000.0)
    got = hvd.allreduce(t, op=hvd.Average, compression=hvd.Compression.fp16)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, t, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name, half", [("fp16", np.float16), ("bf16", torch.bfloat16)])
def test_compression_sends_float32_sums_through_the_wire(name, half):
    import ml_dtypes
    half = ml_dtypes.bfloat16 if half is torch.bfloat16 else half
    compression = getattr(hvd.Compression, name)
    per_rank = [np.random.default_rng(r).standard_normal(70_000).astype(np.float32)
                for r in range(hvd.size())]
    t = torch.from_numpy(per_rank[hvd.rank()].copy())
    got = hvd.allreduce(t, op=hvd.Sum, compression=compression)
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy(), wire_sum(per_rank, half))
    mean, doubles = hvd.grouped_allreduce([t, t.double()], compression=compression)
    want = wire_sum(per_rank, half) / np.float32(hvd.size())
    assert np.allclose(mean.numpy(), want, rtol=1e-6, atol=0)
    exact = sum(p.astype(np.float64) for p in per_rank) / hvd.size()
    assert np.allclose(doubles.numpy(), exact, rtol=1e-12, atol=1e-15)   # float64: as it is
    ints = torch.ones(3, dtype=torch.int32)
    assert hvd.allreduce(ints, op=hvd.Sum, compression=compression).tolist() == \
        [hvd.size()] * 3


def test_a_compression_other_ranks_do_not_use_raises_on_every_rank():
    t = torch.ones(8)
    compression = hvd.Compression.bf16 if hvd.rank() == 0 else hvd.Compression.none
    with pytest.raises(Exception, match="wire"):
        hvd.allreduce(t, compression=compression)


def test_a_joined_rank_takes_part_in_a_compressed_sum():
    rank, size = hvd.rank(), hvd.size()
    if rank == 0:
        hvd.join()
        return
    got = hvd.allreduce(torch.full((5,), float(rank)), op=hvd.Sum,
                        compression=hvd.Compression.bf16)
    assert got.tolist() == [float(sum(range(1, size)))] * 5
    hvd.join()


def test_distributed_optimizer_sends_gradients_through_the_wire():
    model = torch.nn.Linear(64, 32)
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.bf16, op=hvd.Sum)
    x = torch.from_numpy(np.random.default_rng(hvd.rank()).standard_normal((8, 64))
                         .astype(np.float32))
    model(x).square().sum().backward()
    mine = model.weight.grad.numpy().copy()
    opt.step()
    assert opt.reducer.wire == "bfloat16"
    # the same settings take the same path (on one node: node sums, float32; else the wire)
    from mpigrad import Reducer
    with Reducer(comm=opt.reducer.comm, mean=False, wire="bfloat16") as reference:
        want = reference.reduce([mine])[0]
    assert np.array_equal(model.weight.grad.numpy(), want)
    opt.free()


def test_distributed_optimizer_checks_names_and_trains():
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(opt, named_parameters=list(a.named_parameters())
                                 + list(b.named_parameters()))
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(opt, named_parameters=a.named_parameters())
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.full((2, 3), float(hvd.rank() + 1))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    same = hvd.allgather_object([p.detach().numpy().tobytes() for p in model.parameters()])
    assert all(s == same[0] for s in same)
    opt.free()


def test_elastic_state_commits_restores_and_syncs():
    """Without a loss: TorchState keeps the last commit (restore brings it
    back), sync gives every rank rank 0's model, optimizer and values, and
    run calls the function once."""
    torch.manual_seed(hvd.rank())              # every rank starts different
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=hvd.rank())
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(state.epoch)
        return [p.detach().clone() for p in model.parameters()]

    synced = train(state)
    assert calls == [0]                           # rank 0's epoch, once
    blobs = hvd.allgather_object([p.numpy().tobytes() for p in synced])
    assert all(b == blobs[0] for b in blobs)
    state.commit()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    state.epoch = 7
    state.restore()
    assert state.epoch == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), synced))


# -- what every rank must call alike, and what raises on every rank ---------------

def test_scale_factors_and_names_that_differ_raise_on_every_rank():
    rank, size = hvd.rank(), hvd.size()
    x = torch.ones(3)
    with pytest.raises(RuntimeError, match="'postscale_factor' differs"):
        hvd.allreduce(x, op=hvd.Sum, postscale_factor=1.0 if rank == 0 else 2.0)
    with pytest.raises(RuntimeError, match="'prescale_factor' differs"):
        hvd.allreduce(x, op=hvd.Sum, prescale_factor=1.0 if rank == 0 else 2.0)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [size] * 2


def test_named_collectives_match_by_name_in_any_order():
    """Horovod's matching: named async collectives posted in another order
    on some rank are matched by name (never summed with each other's data)."""
    rank, size = hvd.rank(), hvd.size()
    order = ["a", "b", "c"] if rank == 0 else ["c", "b", "a"]
    values_of = {"a": 1.0, "b": 10.0, "c": 100.0}
    handles = {name: hvd.allreduce_async(torch.full((3,), values_of[name] * (rank + 1)),
                                         name=name, op=hvd.Sum) for name in order}
    ranks = sum(r + 1 for r in range(size))
    for name in ("b", "a", "c"):
        assert hvd.synchronize(handles[name]).tolist() == [values_of[name] * ranks] * 3
    # a blocking collective between them: rank 0 posts x before the barrier,
    # the others after it; x completes, and waits are in any order
    x = torch.full((2,), float(rank))
    if rank == 0:
        hx = hvd.allreduce_async(x, name="x", op=hvd.Sum)
    hvd.barrier()
    if rank != 0:
        hx = hvd.allreduce_async(x, name="x", op=hvd.Sum)
    assert hvd.synchronize(hx).tolist() == [sum(range(size))] * 2
    # different kinds under one name are different collectives
    g = hvd.allgather_async(torch.ones(1), name="y")
    r = hvd.allreduce_async(torch.ones(1), name="y", op=hvd.Sum)
    assert hvd.synchronize(r).tolist() == [size] and hvd.synchronize(g).tolist() == [1] * size


def test_duplicate_name_in_flight_raises_locally_only():
    """A second post of a name in flight raises ValueError where it was
    posted; the first completes with the other ranks' posts of it, which
    come after a barrier on some ranks."""
    rank, size = hvd.rank(), hvd.size()
    t = torch.ones(3)
    if rank == 0:
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(t, name="dup", op=hvd.Sum)
    hvd.barrier()
    if rank != 0:
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(t, name="dup", op=hvd.Sum)
    hvd.barrier()
    assert hvd.synchronize(first).tolist() == [size] * 3


def test_what_can_never_match_raises_on_every_rank_naming_it():
    rank = hvd.rank()
    h = hvd.allreduce_async(torch.ones(1), name=f"only-on-{rank}")
    with pytest.raises(RuntimeError, match=r"rank 0 waits for allreduce 'only-on-0', not "
                                           r"posted on rank\(s\) \[1"):
        hvd.synchronize(h)
    # the same name, different tensors: named on every rank
    h = hvd.allreduce_async(torch.ones(1 + rank), name="same")
    with pytest.raises(RuntimeError, match="differs across ranks"):
        hvd.synchronize(h)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2


def test_a_bad_argument_on_one_rank_raises_on_every_rank():
    last = hvd.size() - 1
    if hvd.rank() == last:
        with pytest.raises(ValueError, match="could not convert string to float"):
            hvd.allreduce(torch.ones(3), prescale_factor="x")
    else:
        with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{last}\]"):
            hvd.allreduce(torch.ones(3))
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2


def test_broadcast_object_that_cannot_be_pickled_raises_on_every_rank():
    root = hvd.size() - 1
    expected = TypeError if hvd.rank() == root else hvd.HorovodInternalError
    with pytest.raises(expected, match="picklable"):
        hvd.broadcast_object((lambda: 1) if hvd.rank() == root else None, root_rank=root)
    assert hvd.broadcast_object({"step": 3} if hvd.rank() == root else None,
                                root_rank=root) == {"step": 3}


def test_a_process_set_that_differs_across_ranks_raises_on_every_rank():
    with pytest.raises(RuntimeError, match="'ranks' differs across ranks"):
        hvd.add_process_set([0, 1] if hvd.rank() == 0 else [0])
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32], ids=str)
@pytest.mark.parametrize("op", ["Sum", "Min", "Max", "Product"])
def test_a_joined_rank_takes_part_with_the_ops_identity(op, dtype):
    """Rank 0 has joined: the others' Min, Max, Product (and Sum) are theirs alone."""
    rank, size = hvd.rank(), hvd.size()

    def mine(r):
        return torch.tensor([r + 1, -(r + 1), 2], dtype=dtype)
    if rank == 0:
        hvd.join()
        return
    got = hvd.allreduce(mine(rank), op=getattr(hvd, op))
    others = torch.stack([mine(r) for r in range(1, size)])
    want = {"Sum": others.sum(0), "Min": others.min(0).values, "Max": others.max(0).values,
            "Product": others.prod(0)}[op].to(dtype)
    assert torch.equal(got, want), (got, want)
    hvd.join()


@pytest.mark.parametrize("op, reduce", [("Min", all), ("Max", any), ("Product", all)])
def test_bool_tensors_reduce_by_their_logical_ops(op, reduce):
    rank, size = hvd.rank(), hvd.size()

    def mine(r):
        return torch.tensor([True, r % 2 == 0, False, r == size - 1])
    got = hvd.allreduce(mine(rank), op=getattr(hvd, op))
    want = torch.tensor([reduce(bool(mine(r)[i]) for r in range(size)) for i in range(4)])
    assert got.dtype == torch.bool and torch.equal(got, want)
    with pytest.raises(TypeError, match=r"hvd.Sum of bool arrays is not defined here: "
                                        r"expecting hvd.Max \(any\) or hvd.Min \(all\)"):
        hvd.allreduce(mine(rank), op=hvd.Sum)


def test_shutdown_on_one_rank_ends_the_others_calls_at_once():
    import time
    if hvd.rank() == 0:
        hvd.shutdown()
        time.sleep(2)                            # computes on: the others do not wait
    else:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 0: freed"):
            hvd.allreduce(torch.ones(2))
        assert time.monotonic() - start < 1.5
        hvd.shutdown()


@pytest.mark.parametrize("joined", [False, True], ids=["all ranks", "rank 0 joined"])
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_a_large_float_allreduce_is_the_engines_sum(op, joined):
    """A float sum of 64 KiB or more is summed by mpigrad's engine (its node sums;
    counted: one agreement more than a small sum's matching round, the engine's
    own), a joined rank taking part with zeros of the same shapes; the results
    against the reference from the rank count."""
    import mpigrad
    rank, size = hvd.rank(), hvd.size()
    shapes = [(128, 128), (300,), (5, 7)]                # 66.9 KB of float32
    if joined and rank == 0:
        hvd.join()
        return
    takers = range(1, size) if joined else range(size)
    mine = [values(rank, s, seed=i) for i, s in enumerate(shapes)]

    def agreements(tensors):
        hvd.grouped_allreduce(tensors, op=getattr(hvd, op))   # engines made, plans cached
        before = mpigrad.statistics()
        got = hvd.grouped_allreduce(tensors, op=getattr(hvd, op))
        return got, (mpigrad.statistics() - before).agreements
    _, small = agreements([values(rank, (4, 3))])
    got, large = agreements(mine)
    assert large == small + 1
    for i, (g, s) in enumerate(zip(got, shapes)):
        total = sum(values(r, s, seed=i).double() for r in takers)
        want = total.float() * torch.tensor(1 / size, dtype=torch.float32) \
            if op == "Average" else total.float()                # (the one mean)
        assert torch.equal(g, want), (i, g, want)
    if joined:
        hvd.join()


def test_calls_that_record_no_gradient_give_what_recorded_calls_give():
    """Under no_grad, or on tensors that require none, each differentiable call
    (run without autograd's Function there) gives the recorded call's values,
    and tensors that require no grad."""
    size, rank = hvd.size(), hvd.rank()
    calls = {
        "allreduce": lambda t: [hvd.allreduce(t, op=hvd.Sum)],
        "grouped_allreduce": lambda t: hvd.grouped_allreduce([t, t * 2], op=hvd.Average),
        "allgather": lambda t: [hvd.allgather(t)],
        "broadcast": lambda t: [hvd.broadcast(t, size - 1)],
        "alltoall": lambda t: list(hvd.alltoall(t, [1] * size)),
        "grouped_reducescatter": lambda t: hvd.grouped_reducescatter([t], op=hvd.Sum),
    }
    for name, call in calls.items():
        x = torch.arange(size * 2, dtype=torch.float32).reshape(size, 2) * (rank + 1)
        recorded = call(x.clone().requires_grad_())
        with torch.no_grad():
            quiet = call(x.clone().requires_grad_())
        plain = call(x.clone())
        for got in (quiet, plain):
            assert len(got) == len(recorded), name
            for g, r in zip(got, recorded):
                assert not g.requires_grad and torch.equal(g, r.detach()), name

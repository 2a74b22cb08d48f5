"""The torch.distributed backend "mpigrad" against gloo and against references
computed from the rank count: every collective, every op, dtypes, async
handles, sub-groups, and mismatches raising on every rank. Run under mpiexec
-n 2 and -n 3: the default group is gloo (over a TCP store on 127.0.0.1, its
port sent over MPI), the mpigrad group spans the same ranks."""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from mpi4py import MPI  # noqa: E402

import mpigrad.torch  # noqa: E402,F401  (registers the backend)
from mpigrad import StructureMismatchError  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=2)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
OPS = {"SUM": sum, "MIN": min, "MAX": max, "PRODUCT": lambda xs: _product(xs)}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.uint8, torch.int8]


def _product(values):
    out = 1
    for v in values:
        out *= v
    return out


@pytest.fixture(scope="module")
def groups():
    """(the mpigrad group, the gloo group) over every rank."""
    if not dist.is_initialized():
        import socket
        port = None
        if RANK == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = WORLD.bcast(port)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=RANK,
                                world_size=SIZE)
    return dist.new_group(backend="mpigrad"), dist.group.WORLD


def values(rank, dtype, n=5):
    """Small positive values per rank, exact in every dtype and under every op."""
    return (torch.arange(n) % 3 + rank + 1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_all_reduce_every_op_and_dtype_against_the_reference_and_gloo(groups, op, dtype):
    mine, gloo = groups
    t = values(RANK, dtype)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=mine)
    per_rank = [values(r, torch.float64) for r in range(SIZE)]
    want = torch.stack([OPS[op]([p[i] for p in per_rank]) for i in range(5)])
    assert torch.equal(t.double(), want)
    if dtype not in (torch.float16, torch.bfloat16):       # gloo's half support varies
        g = values(RANK, dtype)
        dist.all_reduce(g, op=getattr(dist.ReduceOp, op), group=gloo)
        assert torch.equal(t, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_avg_is_the_mean(groups, dtype):
    t = values(RANK, dtype)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=groups[0])
    want = sum(values(r, torch.float64) for r in range(SIZE)) / SIZE
    assert torch.allclose(t.double(), want, rtol=1e-2 if dtype != torch.float32 else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["SUM", "AVG"])
def test_large_sums_through_the_engine_equal_the_small_path(groups, op, dtype):
    """64 KiB and more go through mpigrad's Reducer (node sums), less through
    MPI's Allreduce: the same values either way, against the reference."""
    n = 50_000                                      # 100-200 KB
    big = (torch.arange(n) % 7 + RANK).to(dtype)
    small = big[:1000].clone()
    for t in (big, small):
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=groups[0])
    want = sum((torch.arange(n) % 7 + r).double() for r in range(SIZE))
    want = want / SIZE if op == "AVG" else want
    assert torch.allclose(big.double(), want, rtol=1e-3 if dtype == torch.float16 else 1e-6)
    assert torch.equal(big[:1000], small)


@pytest.mark.parametrize("op", ["BAND", "BOR", "BXOR"])
def test_bitwise_ops_on_integers_and_bools(groups, op):
    mine, gloo = groups
    for dtype in (torch.int32, torch.uint8):
        t, g = (torch.tensor([RANK + 1, 6, 2 ** RANK], dtype=dtype) for _ in range(2))
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=mine)
        dist.all_reduce(g, op=getattr(dist.ReduceOp, op), group=gloo)
        assert torch.equal(t, g)
    flags = torch.tensor([RANK == 0, True, False])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mine)
    assert flags.tolist() == [True, True, False]


def test_async_work_and_future(groups):
    t = torch.ones(4)
    work = dist.all_reduce(t, group=groups[0], async_op=True)
    assert work.wait() and work.is_completed()
    assert work.get_future().wait()[0].tolist() == [SIZE] * 4


def test_a_failed_small_calls_work_raises_and_its_future_is_in_error(groups):
    """A small call runs on the caller's thread (its Work done when it returns): one
    that fails on every rank (the last rank's shape differs) gives a Work that is
    completed, not a success, whose wait raises the call's own error and whose
    future is in error, as a queued call's; the next call sums as before."""
    t = torch.ones(4 if RANK < SIZE - 1 else 5)
    work = dist.all_reduce(t, group=groups[0], async_op=True)
    assert work.is_completed() and not work.is_success()
    with pytest.raises(StructureMismatchError, match="shape|differs"):
        work.wait()
    with pytest.raises(RuntimeError, match="StructureMismatchError|differs"):
        work.get_future().wait()
    ok = torch.ones(4)
    dist.all_reduce(ok, group=groups[0])
    assert ok.tolist() == [SIZE] * 4


def test_a_tensor_called_again_is_read_where_its_memory_is_now(groups):
    """A small all_reduce of the same tensor again reuses its host view only while the
    tensor is where it was: after its memory moves (``set_`` onto another storage,
    ``.data`` replaced, a transposed layout of the same memory) each call sums what
    the tensor holds now, not what the old view sees."""
    mine = groups[0]
    t = torch.full((4, 4), float(RANK + 1))
    for _ in range(2):
        t.fill_(RANK + 1.0)
        dist.all_reduce(t, group=mine)
        assert (t == SIZE * (SIZE + 1) / 2).all()
    old = t.untyped_storage()
    t.set_(torch.full((4, 4), 10.0 * (RANK + 1)))          # another storage
    dist.all_reduce(t, group=mine)
    assert (t == 10 * SIZE * (SIZE + 1) / 2).all() and t.untyped_storage() is not old
    t.data = torch.arange(16.0).reshape(4, 4) * (RANK + 1)  # .data replaced
    dist.all_reduce(t, group=mine)
    assert torch.equal(t, torch.arange(16.0).reshape(4, 4) * (SIZE * (SIZE + 1) / 2))
    base = torch.arange(16.0) * (RANK + 1)
    t.set_(base.untyped_storage(), 0, (4, 4), (1, 4))     # the same memory, transposed
    with pytest.raises(ValueError, match="contiguous"):
        dist.all_reduce(t, group=mine)


def test_a_repeated_small_call_runs_after_the_calls_made_before_it(groups):
    """A repeated small all_reduce (run on the caller's thread where the group's
    worker is idle) still runs after a large one made before it and running on
    the worker: its tensor, a view into the large one, sees that sum first."""
    mine = groups[0]
    big = torch.empty(1 << 21)                               # 8 MiB: on the worker
    head = big[:4]
    total = SIZE * (SIZE + 1) / 2
    for _ in range(3):                                      # the 2nd and 3rd: kept
        big.fill_(RANK + 1.0)
        work = dist.all_reduce(big, group=mine, async_op=True)
        dist.all_reduce(head, op=dist.ReduceOp.MAX, group=mine)
        work.wait()
        # the sum first, then the max of the sums; the max first would give SIZE * SIZE
        assert head.tolist() == [total] * 4 and big[-1].item() == total


def test_coalesced_all_reduce(groups):
    tensors = [torch.full((3,), float(RANK + 1)), torch.full((2, 2), 2.0 * (RANK + 1))]
    dist.all_reduce_coalesced(tensors, group=groups[0])
    total = SIZE * (SIZE + 1) / 2
    assert tensors[0].tolist() == [total] * 3 and tensors[1].flatten().tolist() == [2 * total] * 4


def test_broadcast_from_every_root(groups):
    for root in range(SIZE):
        t = torch.full((3,), float(RANK)) if RANK == root else torch.zeros(3)
        dist.broadcast(t, src=root, group=groups[0])
        assert t.tolist() == [float(root)] * 3


def test_all_gather_forms(groups):
    mine, _ = groups
    out = [torch.empty(2, dtype=torch.int64) for _ in range(SIZE)]
    dist.all_gather(out, torch.full((2,), RANK), group=mine)
    assert [o.tolist() for o in out] == [[r, r] for r in range(SIZE)]
    flat = torch.empty(2 * SIZE)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(RANK)), group=mine)
    assert flat.tolist() == [float(r) for r in range(SIZE) for _ in range(2)]
    # the input may alias this rank's part of the output (FSDP2 does so)
    flat = torch.zeros(2 * SIZE)
    flat[2 * RANK:2 * RANK + 2] = RANK + 10.0
    dist.all_gather_into_tensor(flat, flat[2 * RANK:2 * RANK + 2], group=mine)
    assert flat.tolist() == [r + 10.0 for r in range(SIZE) for _ in range(2)]
    objects = [None] * SIZE
    dist.all_gather_object(objects, {"rank": RANK}, group=mine)
    assert objects == [{"rank": r} for r in range(SIZE)]


@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX"])
def test_reduce_scatter_forms(groups, op):
    mine = groups[0]
    whole = [torch.arange(2.0 * SIZE) * (r + 1) for r in range(SIZE)]
    reduce = {"SUM": lambda xs: sum(xs), "AVG": lambda xs: sum(xs) / SIZE,
              "MAX": lambda xs: torch.stack(xs).max(0).values}[op]
    want = reduce(whole)[2 * RANK:2 * RANK + 2]
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, whole[RANK].clone(), op=getattr(dist.ReduceOp, op),
                               group=mine)
    assert torch.allclose(out, want)
    out = torch.empty(2)
    dist.reduce_scatter(out, list(whole[RANK].clone().chunk(SIZE)),
                        op=getattr(dist.ReduceOp, op), group=mine)
    assert torch.allclose(out, want)


def test_all_to_all_forms_with_splits(groups):
    mine = groups[0]
    # rank r sends r + 1 + q rows of value 100 r + q to rank q
    sends = [torch.full((RANK + 1 + q, 2), 100.0 * RANK + q) for q in range(SIZE)]
    receives = [torch.empty(r + 1 + RANK, 2) for r in range(SIZE)]
    dist.all_to_all(receives, sends, group=mine)
    for r, got in enumerate(receives):
        assert got.eq(100.0 * r + RANK).all()
    out = torch.empty(sum(r + 1 + RANK for r in range(SIZE)), 2)
    dist.all_to_all_single(out, torch.cat(sends), [r + 1 + RANK for r in range(SIZE)],
                           [RANK + 1 + q for q in range(SIZE)], group=mine)
    assert torch.equal(out, torch.cat(receives))
    even = torch.arange(SIZE * 2.0) + 10 * RANK
    got = torch.empty(SIZE * 2)
    dist.all_to_all_single(got, even, group=mine)
    assert got.tolist() == [10.0 * r + 2 * RANK + i for r in range(SIZE) for i in range(2)]


def test_reduce_gather_scatter_to_and_from_a_root(groups):
    mine, root = groups[0], SIZE - 1
    t = torch.full((2,), float(RANK + 1))
    dist.reduce(t, dst=root, group=mine)
    if RANK == root:
        assert t.tolist() == [SIZE * (SIZE + 1) / 2] * 2
    gathered = [torch.empty(2) for _ in range(SIZE)] if RANK == root else None
    dist.gather(torch.full((2,), float(RANK)), gathered, dst=root, group=mine)
    if RANK == root:
        assert [g.tolist() for g in gathered] == [[float(r)] * 2 for r in range(SIZE)]
    out = torch.empty(3)
    parts = [torch.full((3,), float(r)) for r in range(SIZE)] if RANK == root else None
    dist.scatter(out, parts, src=root, group=mine)
    assert out.tolist() == [float(RANK)] * 3
    objects = [{"from": RANK}] if RANK == root else [None]
    dist.broadcast_object_list(objects, src=root, group=mine)
    assert objects == [{"from": root}]


def test_send_recv_and_batch_in_a_ring(groups):
    mine = groups[0]
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got = torch.empty(3)
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(RANK)), right, group=mine),
           dist.P2POp(dist.irecv, got, left, group=mine)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert got.tolist() == [float(left)] * 3
    if RANK == 0:
        dist.send(torch.arange(4.0), dst=1, group=mine)
    elif RANK == 1:
        t = torch.empty(4)
        dist.recv(t, src=0, group=mine)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    dist.barrier(group=mine)
    # torch's front end takes monitored_barrier for gloo groups only; the
    # group's own names a rank that does not come, as every barrier here does
    mine.monitored_barrier()


def test_sub_groups_of_even_and_odd_ranks(groups):
    evens = dist.new_group(list(range(0, SIZE, 2)), backend="mpigrad")
    odds = dist.new_group(list(range(1, SIZE, 2)), backend="mpigrad")
    mine = evens if RANK % 2 == 0 else odds
    members = list(range(RANK % 2, SIZE, 2))
    t = torch.full((2,), float(RANK))
    dist.all_reduce(t, group=mine)
    assert t.tolist() == [float(sum(members))] * 2
    assert dist.get_world_size(mine) == len(members)


def test_mismatches_raise_on_every_rank_naming_the_difference(groups):
    mine = groups[0]
    with pytest.raises(StructureMismatchError, match="'op' differs"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.SUM if RANK else dist.ReduceOp.MAX,
                        group=mine)
    with pytest.raises(StructureMismatchError, match=r"float32\[2\].*float32\[3\]|differ"):
        dist.all_reduce(torch.ones(2 + (RANK == SIZE - 1)), group=mine)
    with pytest.raises(StructureMismatchError, match="all_reduce.*broadcast|broadcast.*all_reduce"):
        if RANK == 0:
            dist.broadcast(torch.ones(2), src=0, group=mine)
        else:
            dist.all_reduce(torch.ones(2), group=mine)
    t = torch.ones(2)
    dist.all_reduce(t, group=mine)                   # the group goes on
    assert t.tolist() == [float(SIZE)] * 2


def test_what_the_backend_cannot_do_is_a_clear_error_on_every_rank(groups):
    from mpigrad import PeerError
    mine = groups[0]
    with pytest.raises((TypeError, PeerError), match="AVG needs floating-point"):
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG, group=mine)
    bad = torch.ones(4, 2).t() if RANK == 0 else torch.ones(2, 4)
    with pytest.raises((ValueError, PeerError), match="contiguous"):
        dist.all_reduce(bad, group=mine)


def test_mpigrad_reproducible_makes_the_backends_sums_exact(groups, monkeypatch):
    """MPIGRAD_REPRODUCIBLE=1 (set alike on every rank) makes the group's sums exact: the
    correctly rounded sum of every rank's tensor, whatever the rank count."""
    import numpy as np
    from helpers import exact_reference
    monkeypatch.setenv("MPIGRAD_REPRODUCIBLE", "1")
    group = dist.new_group(backend="mpigrad")
    every = [(np.random.default_rng(r).standard_normal(5000)
              * 10.0 ** np.random.default_rng(r).integers(-20, 20, 5000)).astype(np.float32)
             for r in range(WORLD.size)]
    t = torch.from_numpy(every[RANK].copy())
    dist.all_reduce(t, group=group)
    want = exact_reference([[a] for a in every])[0]
    assert np.array_equal(t.numpy().view(np.uint32), want.view(np.uint32))
    dist.destroy_process_group(group)


def test_mpigrad_wire_reaches_the_backends_large_sums(groups, monkeypatch):
    """MPIGRAD_WIRE (set alike on every rank) gives the group's Reducers their wire: with one
    rank per node (MPIGRAD_NODE_SIZE=1) float32 sums go through MPI, so the bfloat16 wire."""
    import numpy as np
    from mpigrad import Reducer
    monkeypatch.setenv("MPIGRAD_WIRE", "bfloat16")
    monkeypatch.setenv("MPIGRAD_NODE_SIZE", "1")
    group = dist.new_group(backend="mpigrad")
    data = np.random.default_rng(RANK).standard_normal(70_000).astype(np.float32)
    t = torch.from_numpy(data.copy())
    dist.all_reduce(t, group=group)
    with Reducer(WORLD, mean=False) as reducer:         # the same wire, from the environment
        assert reducer.wire == "bfloat16"
        want = reducer.reduce([data])[0]
    float32 = sum(WORLD.allgather(data))                 # rank order, no rounding on a wire
    assert np.array_equal(t.numpy(), want) and not np.array_equal(t.numpy(), float32)
    dist.destroy_process_group(group)


@pytest.mark.parametrize("nbytes", [1 << 10, 16 << 10, 1 << 16, 4 << 20])
def test_an_all_reduce_costs_what_the_reducer_costs(groups, nbytes):
    from mpigrad._comm.checked import inline_capacity
    """One agreement per call; a float sum of 64 KiB or more is the engine's own
    reduction, making exactly the MPI operations Reducer.reduce makes of the same
    tensor (counted by mpigrad.statistics); a smaller one, the agreement and one
    Allreduce, or of at most the agreement's capacity (4 KiB at 2 and 3 ranks),
    the agreement alone: the data rides on it."""
    mine, _ = groups
    t = torch.full((nbytes // 4,), float(RANK + 1))
    dist.all_reduce(t, group=mine)                      # its engine made, its plan cached
    before = mpigrad.statistics()
    dist.all_reduce(t, group=mine)
    backend = mpigrad.statistics() - before
    with mpigrad.Reducer(mean=False) as reducer:
        reducer.reduce([t], inplace=True)
        before = mpigrad.statistics()
        reducer.reduce([t], inplace=True)
        direct = mpigrad.statistics() - before
    assert backend.calls == direct.calls == 1
    assert backend.agreements == direct.agreements == 1
    if nbytes >= 1 << 16:
        assert backend.operations == direct.operations
    else:
        assert backend.operations == (1 if nbytes <= inline_capacity(SIZE) else 2)
    expected = (SIZE * (SIZE + 1) // 2) * SIZE ** 3     # summed 4 times over
    assert torch.equal(t, torch.full_like(t, float(expected)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("op", ["SUM", "AVG"])
def test_a_reduce_scatter_moves_its_share_once_not_the_whole_buffer(groups, dtype, op):
    """reduce_scatter_tensor (FSDP2's every backward) of 4 MiB per rank: each
    rank moves (p-1)/p of the buffer (mpigrad.statistics counts it: MPI's
    Reduce_scatter by its definition, cross-memory reads as they are) plus
    the agreement's few KiB, not an allreduce of all of it; the reference
    from the rank count."""
    if op == "AVG" and dtype == torch.int64:
        pytest.skip("AVG needs floating-point tensors (as gloo)")
    mine, _ = groups
    n = (4 << 20) // 8
    inp = ((torch.arange(SIZE * n) % 7) + RANK).to(dtype)
    out = torch.empty(n, dtype=dtype)
    reduce_op = getattr(dist.ReduceOp, op)
    dist.reduce_scatter_tensor(out, inp, op=reduce_op, group=mine)     # plans and engines made
    before = mpigrad.statistics()
    dist.reduce_scatter_tensor(out, inp, op=reduce_op, group=mine)
    moved = (mpigrad.statistics() - before).moved
    whole = inp.numel() * (4 if dtype == torch.bfloat16 else inp.element_size())   # (wire)
    assert (SIZE - 1) / SIZE * whole <= moved <= (SIZE - 1) / SIZE * whole + (64 << 10)
    part = (torch.arange(RANK * n, (RANK + 1) * n) % 7).double()
    want = sum(part + r for r in range(SIZE))
    if op == "AVG":
        want = want * (1 / SIZE)
    assert torch.allclose(out.double(), want.to(dtype).double(), rtol=1e-2 if
                          dtype == torch.bfloat16 else 1e-6)

"""Reducer(reproducible=True): the same bits for the same addends at any rank count.

Twelve fixed addend pytrees (float32, float16, bfloat16, float64 and complex64 leaves with
magnitudes from 1e-30 to 1e30, exact cancellations, subnormals and signed zeros) are split
across the ranks in several ways (blocks, round robin, all on one rank, a random draw),
accumulated per rank in an ExactSum and reduced: every split, at every rank count the suite
runs at (1 through COMM_SELF, 2, 3, and 2 nodes x 2), gives the exact sum rounded once,
computed serially with fractions. A 50-step MLP whose micro-batches are split over the ranks
ends bitwise equal to the same run on one rank."""

import numpy as np
import pytest
from mpi4py import MPI

from helpers import assert_bitwise_equal, assert_same_on_all_ranks, exact_reference, nodes
from mpigrad import ExactSum, PeerError, Reducer, StructureMismatchError
from mpigrad._base.dtypes import bfloat16

pytestmark = pytest.mark.mpi

COUNT = 12


def addend(k):
    """The k-th of the fixed addend pytrees (the same on every rank)."""
    rng = np.random.default_rng(1000 + k)

    def wide(size, spread, dtype):
        values = rng.standard_normal(size) * 10.0 ** rng.integers(-spread, spread + 1, size)
        return values.astype(dtype)

    tree = {"w": wide(64, 30, np.float32), "h": wide(16, 4, np.float16),
            "b": wide(16, 30, bfloat16), "d": wide(16, 30, np.float64),
            "c": (wide(8, 20, np.float32) + 1j * wide(8, 20, np.float32)).astype(np.complex64)}
    partner = np.random.default_rng(1000 + (k + 1) % COUNT)
    twin = partner.standard_normal(64) * 10.0 ** partner.integers(-30, 31, 64)
    tree["w"][:4] = -twin[:4].astype(np.float32) if k % 2 else tree["w"][:4]   # cancellations
    tree["w"][4] = np.float32(1e-45) * (k + 1)                                  # subnormals
    tree["w"][5] = np.float32(-0.0 if k % 3 else 0.0)                           # signed zeros
    tree["w"][6] = np.float32(-0.0)
    tree["h"][0] = np.float16(6e-8) * (k % 4)
    return tree


ADDENDS = [addend(k) for k in range(COUNT)]
SPLITS = {
    "blocks": lambda k, p: k * p // COUNT,
    "round robin": lambda k, p: k % p,
    "all on the last rank": lambda k, p: p - 1,
    "a random draw": lambda k, p: int(np.random.default_rng(7).integers(0, p, COUNT)[k]),
}


@pytest.fixture(scope="module")
def reference():
    return {divisor: exact_reference(ADDENDS, divisor) for divisor in (1, COUNT)}


def mine(split, comm):
    """This rank's ExactSum of its share of the addends under ``split``."""
    acc = ExactSum()
    for k in range(COUNT):
        if SPLITS[split](k, comm.size) == comm.rank:
            acc.add(ADDENDS[k])
    if acc.count == 0:                     # a rank with no micro-batch adds nothing
        acc.add({key: np.zeros_like(a) for key, a in ADDENDS[0].items()})
    return acc


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("mean", [False, True])
def test_every_split_at_every_rank_count_gives_the_exact_sum(comm, reference, split, mean):
    with Reducer(comm, reproducible=True, mean=mean, degree=COUNT,
                 chunk_bytes=256) as reducer:
        got = reducer.reduce(mine(split, comm))
        assert reducer.backend.startswith("exact")
    want = reference[COUNT if mean else 1]
    assert sorted(got) == sorted(want)
    for key in want:
        assert_bitwise_equal(got[key], want[key], f"{split}, {key}")


@pytest.mark.parametrize("piece", [5, 64])
def test_in_small_pieces_and_with_skipped_leaves(comm, reference, monkeypatch, piece):
    """Summed a piece of elements at a time (each piece its own exponents and
    limbs), with a skipped leaf, through an ExactSum and as plain float32
    gradients: the same exact sums."""
    from mpigrad._engine import exact as engine_exact
    monkeypatch.setattr(engine_exact, "PIECE", piece)
    skip = [key == "d" for key in sorted(ADDENDS[0])]
    with Reducer(comm, reproducible=True, mean=True, degree=COUNT, skip=skip) as reducer:
        acc = mine("round robin", comm)
        got = reducer.reduce(acc)
    with Reducer(comm, reproducible=True, mean=True, degree=COUNT) as reducer:
        plain = reducer.reduce([ADDENDS[comm.rank]["w"]])[0]
    for key, want in reference[COUNT].items():
        if key == "d":
            assert got[key] is acc.like["d"]
        else:
            assert_bitwise_equal(got[key], want, f"piece {piece}, {key}")
    want = exact_reference([[ADDENDS[r]["w"]] for r in range(comm.size)], COUNT)[0]
    assert_bitwise_equal(plain, want, f"piece {piece}, float32")


def test_the_same_bits_through_either_face_and_any_layout(comm, reference):
    """One addend per rank, reduced as arrays (plain, in place, started) and as
    torch tensors: the exact sum of the ranks' addends."""
    torch = pytest.importorskip("torch")
    want = exact_reference(ADDENDS[:comm.size])
    grads = {key: a.copy() for key, a in ADDENDS[comm.rank].items()}
    with Reducer(comm, reproducible=True, mean=False, bucket_bytes=64) as reducer:
        plain = reducer.reduce(grads)
        started = {key: a.copy() for key, a in grads.items()}
        pending = reducer.start(started)
        pending.ready(*range(5))
        pending.wait()
        reducer.reduce(grads, inplace=True)
        tensors = reducer.reduce({key: torch.from_numpy(a) for key, a in ADDENDS[comm.rank].items()
                                  if key != "b"})
    for key in want:
        for label, result in (("plain", plain), ("started", started), ("in place", grads)):
            assert_bitwise_equal(result[key], want[key], f"{label} {key}")
        if key != "b":
            assert_bitwise_equal(tensors[key].numpy(), want[key], f"torch {key}")


def test_float32_gradients_straight_from_their_bits_wide_spans_and_non_finite(comm):
    """float32 gradients (no ExactSum) are read from their bits: elements whose
    magnitudes across the ranks span over one limb give the exact sum as well,
    and an infinity or NaN its element's result."""
    def mine(rank):
        grad = ADDENDS[rank]["w"].copy()
        grad[7] = np.inf if rank == 0 else grad[7]
        grad[8] = -np.inf if rank == comm.size - 1 else grad[8]
        grad[9] = np.nan if rank == comm.size - 1 else grad[9]
        return grad
    finite = [ADDENDS[r]["w"].copy() for r in range(comm.size)]
    for grad in finite:
        grad[7:10] = 0
    want = exact_reference([[g] for g in finite])[0]
    want[9] = np.nan
    want[7], want[8] = np.inf, -np.inf
    with Reducer(comm, reproducible=True, mean=False, check_finite=True) as reducer:
        got = reducer.reduce([mine(comm.rank)])[0]
        assert reducer.finite is False
    assert_bitwise_equal(got, want)


def test_reduce_scatter_keeps_this_ranks_shard_of_the_exact_sums(comm):
    """reduce_scatter (and its started form): this rank's shard, per wire dtype,
    of the exact sums rounded once to the wire dtype (float32 for half
    precision); allgather_shards puts them back."""
    tree = {key: a.copy() for key, a in ADDENDS[comm.rank].items() if key != "c"}
    wide = [{key: a.astype(np.float32) if a.dtype.itemsize == 2 else a
             for key, a in ADDENDS[r].items() if key != "c"} for r in range(comm.size)]
    want = exact_reference(wide)
    with Reducer(comm, reproducible=True, mean=False, bucket_bytes=128) as reducer:
        shards = reducer.reduce_scatter(tree)
        pending = reducer.start_reduce_scatter(tree)
        pending.ready(*range(4))
        started = pending.wait()
        mine = reducer.shards(tree)
        back = {key: np.zeros_like(a) for key, a in tree.items()}
        reducer.allgather_shards(shards, into=back)
    keys = sorted(tree)
    for dtype, ranges in mine.items():
        expected = np.concatenate([want[keys[i]].reshape(-1)[a:b] for i, a, b in ranges]
                                  or [np.zeros(0, dtype)])
        assert_bitwise_equal(shards[dtype], expected, dtype.name)
        assert_bitwise_equal(started[dtype], expected, f"started {dtype.name}")
    for key in ("w", "d"):
        assert_bitwise_equal(back[key], want[key], key)


def test_jax_pytrees_and_skipped_leaves(comm):
    jnp = pytest.importorskip("jax.numpy")
    want = exact_reference([[ADDENDS[r]["w"]] for r in range(comm.size)])[0]
    with Reducer(comm, reproducible=True, mean=False, skip=[True, False]) as reducer:
        skipped = np.ones(3, np.float32)
        out = reducer.reduce([skipped, jnp.asarray(ADDENDS[comm.rank]["w"])])
    assert out[0] is skipped
    assert_bitwise_equal(np.asarray(out[1]), want)


def test_a_mlp_trained_on_split_micro_batches_ends_bitwise_as_on_one_rank(comm):
    """50 steps of SGD on an MLP, a global batch of 8 micro-batches split over
    the ranks, each micro-batch's gradients added to an ExactSum: the
    parameters end bitwise equal to the same training on one rank."""
    def run(over, micro):
        rng = np.random.default_rng(0)
        params = [rng.standard_normal((8, 16)).astype(np.float32) * 0.3,
                  np.zeros(16, np.float32), rng.standard_normal((16, 1)).astype(np.float32) * 0.3]
        data = np.random.default_rng(1)
        with Reducer(over, reproducible=True, degree=8) as reducer:
            for _ in range(50):
                x = data.standard_normal((8, 4, 8)).astype(np.float32)
                y = np.sin(x.sum(axis=2, keepdims=True))
                acc = ExactSum()
                for m in micro:
                    acc.add(_mlp_grads(params, x[m], y[m]))
                grads = reducer.reduce(acc)
                params = [p - np.float32(0.1) * g for p, g in zip(params, grads)]
        return params

    ones = run(MPI.COMM_SELF, range(8))
    split = run(comm, [m for m in range(8) if m % comm.size == comm.rank] if comm.size <= 8
                else range(8))
    for a, b in zip(split, ones):
        assert_bitwise_equal(a, b, "parameters")
    assert_same_on_all_ranks(comm, split)


def _mlp_grads(params, x, y):
    """The gradients of the mean squared error of a tanh MLP (numpy, float32)."""
    w1, b1, w2 = params
    h = np.tanh(x @ w1 + b1)
    err = (h @ w2 - y) * np.float32(2.0 / len(x))
    dh = (err @ w2.T) * (1 - h * h)
    return [x.T @ dh, dh.sum(axis=0), h.T @ err]


def test_an_exact_sum_on_one_rank_and_arrays_on_another_raise_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    tree = {key: a.copy() for key, a in ADDENDS[0].items()}
    acc = ExactSum()
    acc.add(tree)
    with Reducer(comm, reproducible=True) as reducer:
        with pytest.raises(StructureMismatchError, match="reduced"):
            reducer.reduce(acc if comm.rank == 0 else tree)
        assert reducer.reduce(tree)["w"].dtype == np.float32     # still usable


def test_what_it_cannot_do_exactly_it_refuses_on_every_rank(comm):
    acc = ExactSum()
    acc.add([np.ones(3, np.float32)])
    with Reducer(comm) as plain:
        with pytest.raises((TypeError, PeerError), match="reproducible"):
            plain.reduce(acc if comm.rank == 0 else [np.ones(3, np.float32)])
    with Reducer(comm, reproducible=True) as reducer:
        with pytest.raises(TypeError, match="not in place"):
            reducer.reduce(acc, inplace=True)
        pending = reducer.start([np.ones(3, np.float32)])      # ready()'s checks, as ever
        pending.ready(0)
        with pytest.raises(ValueError, match="gradient 0 was already marked ready"):
            pending.ready(0)
        with pytest.raises(ValueError, match=r"expecting gradient positions in \[0, 1\)"):
            pending.ready(1)
        assert pending.wait()[0][0] == 1.0                     # the mean of ones
    for bad, match in (({"wire": "bfloat16"}, "the wire rounds every addend"),
                       ({"shared_memory": True}, "exact sums are integer sums"),
                       ({"degree": 1 << 14}, "degree below 16384")):
        with pytest.raises(ValueError, match=match):
            Reducer(comm, reproducible=True, **bad)


def test_verify_and_private_in_place_calls(comm):
    """verify=True checks the exact sums across the ranks; with it (a private
    call) an in-place call writes the caller's arrays only once every piece
    is summed; the results are the exact sums either way."""
    want = exact_reference([[ADDENDS[r]["w"]] for r in range(comm.size)])[0]
    strided = np.zeros(128, np.float32)[::2]
    strided[...] = ADDENDS[comm.rank]["w"]
    with Reducer(comm, reproducible=True, mean=False, verify=True) as reducer:
        mine = ADDENDS[comm.rank]["w"].copy()
        reducer.reduce([mine, strided], inplace=True)
    assert_bitwise_equal(mine, want)
    assert_bitwise_equal(np.ascontiguousarray(strided), want, "strided")


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_reproducible_on_one_rank_only_is_named_as_the_user_set_it(comm, monkeypatch, how):
    """Not as the node-sum settings it turns off (cross_memory, shared_memory)."""
    if comm.size == 1:
        pytest.skip("one rank cannot differ from the others")
    last = comm.rank == comm.size - 1
    if how == "environment" and last:
        monkeypatch.setenv("MPIGRAD_REPRODUCIBLE", "1")
    with pytest.raises(StructureMismatchError, match=r"setting 'reproducible' differs across "
                                                     r"ranks: rank 0 has False, rank "
                                                     rf"{comm.size - 1} has True"):
        Reducer(comm, reproducible=True if how == "argument" and last else None)


@pytest.mark.parametrize("mean", [False, True])
def test_float32_blocks_wider_than_a_limb_across_arrays_and_pieces_summed_apart_in_place(
        comm, monkeypatch, mean):
    """float32 gradients agree one pair of exponents per block: blocks whose
    values span more than a limb (a value 2**-60 of its neighbours' on one
    rank, an infinity on another) straddling two arrays and two pieces are
    summed apart, per element; in place, the same exact sums as the reference."""
    from mpigrad._engine import exact as engine_exact
    monkeypatch.setattr(engine_exact, "BLOCK", 4)
    monkeypatch.setattr(engine_exact, "PIECE", 10)
    rng = np.random.default_rng(7)
    sizes = (7, 13, 9)
    addends = [[rng.standard_normal(n).astype(np.float32) for n in sizes]
               for _ in range(comm.size)]
    for r, arrays in enumerate(addends):
        arrays[0][6] = np.float32(2.0 ** -60) * (r + 1)       # the block of 6-9, across arrays
        arrays[1][r + 2] = np.float32(-(2.0 ** -70))          # in the piece of 10-19
    addends[-1][2][4] = np.inf
    finite = [[a.copy() for a in arrays] for arrays in addends]
    finite[-1][2][4] = 0
    divisor = comm.size if mean else 1
    want = exact_reference(finite, divisor)
    want[2][4] = np.inf
    grads = [a.copy() for a in addends[comm.rank]]
    with Reducer(comm, reproducible=True, mean=mean) as reducer:
        out = reducer.reduce(grads, inplace=True)
    for i, (o, g) in enumerate(zip(out, grads)):
        assert o is g
        assert_bitwise_equal(o, want[i], f"array {i}")


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_gradients_summed_by_float32_blocks_round_once(comm, dtype, mean):
    """float16 and bfloat16 gradients alone in a call take the float32 blocks
    (their values are exact in float32; on one node, the float64 pass), in place
    and not: the exact sum (or mean) rounded once to the gradient's dtype, never
    twice (at 3 ranks, the sum 1 + a half ulp + 2**-24 rounds up; rounded to
    nearest float32 first, it would become the tie 1 + a half ulp and round down
    to 1); wide spans, subnormals, infinities, NaN."""
    from mpigrad._engine import exact as engine_exact
    half_ulp, below = (2.0 ** -11 if dtype == np.float16 else 2.0 ** -8), 2.0 ** -24
    rng = np.random.default_rng(11)
    sizes = (70, 33)

    def grads_of(rank):
        spread = 4 if dtype == np.float16 else 30
        arrays = [(rng.standard_normal(n) * 10.0 ** rng.integers(-spread, spread + 1, n)
                   ).astype(dtype) for n in sizes]
        arrays[0][3] = -np.asarray(np.finfo(dtype).smallest_subnormal, dtype) * (rank + 1)
        return arrays
    addends = [grads_of(r) for r in range(comm.size)]
    addends[-1][1][5] = np.inf
    addends[0][1][6] = np.nan
    finite = [[a.copy() for a in arrays] for arrays in addends]
    finite[-1][1][5] = finite[0][1][6] = 0
    divisor = comm.size if mean else 1
    want = exact_reference(finite, divisor)
    want[1][5], want[1][6] = np.inf, np.nan
    calls = []
    real = engine_exact.exact.to_limb_float32

    def counted(values, pairs):
        calls.append(values.dtype)
        return real(values, pairs)
    with Reducer(comm, reproducible=True, mean=mean) as reducer:
        setattr(engine_exact.exact, "to_limb_float32", counted)
        try:
            plain = reducer.reduce(addends[comm.rank])
            grads = [a.copy() for a in addends[comm.rank]]
            reducer.reduce(grads, inplace=True)
            tie = np.zeros(40, dtype)           # each rank one addend of the tie
            tie[0] = [1.0, half_ulp, below][comm.rank % 3]
            (tied,) = reducer.reduce([tie])
            backend = reducer.backend
        finally:
            setattr(engine_exact.exact, "to_limb_float32", real)
    if backend == engine_exact.NAME:    # the float32 blocks' limbs (else one float64 pass)
        assert calls and all(d == np.float32 for d in calls)
    else:
        assert backend == engine_exact.NODE_NAME and not calls
    for i in range(len(sizes)):
        assert_bitwise_equal(plain[i], want[i], f"plain {i}")
        assert_bitwise_equal(grads[i], want[i], f"in place {i}")
    ties = [[np.full(1, [1.0, half_ulp, below][r % 3], dtype)] for r in range(comm.size)]
    assert_bitwise_equal(tied[:1], exact_reference(ties, divisor)[0], "the tie")
    if comm.size == 3 and not mean:     # the exact sum is above the tie: rounded up
        assert tied[0] == np.asarray(1.0 + 2 * half_ulp, dtype)


def node_gradients(rank, size):
    """float32 gradients of rank ``rank`` of ``size``: two cross-memory pieces (300 001
    elements), magnitudes over six decades, runs wider than a limb (values
    times 1e30), subnormals, signed zeros, exact cancellations, infinities and NaN."""
    rng = np.random.default_rng(300 + rank)
    sizes = (300_001, 4099, 33, 1)
    grads = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
             for n in sizes]
    big = grads[0]
    big[rng.integers(0, big.size, 50)] *= np.float32(1e30)
    big[5::997] = np.float32(1e-42) * (rank + 1)
    big[7::1013] = np.float32(-0.0)
    twin = np.random.default_rng(999).standard_normal(big[11::1009].size).astype(np.float32)
    big[11::1009] = twin if rank == 0 else -twin if rank == size - 1 else 0
    big[13] = np.inf if rank == 0 else big[13]
    big[17] = np.nan if rank == size - 1 else big[17]
    big[19] = np.inf if rank == 0 else -np.inf if rank == size - 1 else big[19]
    return grads


@pytest.mark.parametrize("flush", [False, True], ids=["", "denormals flushed"])
@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
def test_float32_exact_sums_on_one_node_take_one_cross_memory_pass_with_the_same_bits(
        comm, request, mean, flush):
    """On a node that holds every rank, exact float32 sums and means (by 3 too)
    are summed in one cross-memory pass
    (float64 sums of the runs that fit a limb, the others apart): every element
    bitwise what the integer sums through MPI give (shared_memory=False), in place
    and not, the small arrays equal to the fractions' reference. Elsewhere (one
    rank, several nodes, no cross-memory attach) the sums go through MPI. Both
    count subnormals on a thread that flushes them (torch.set_flush_denormal)."""
    from mpigrad._engine.exact import NAME, NODE_NAME
    if flush:
        torch = pytest.importorskip("torch")
        assert torch.set_flush_denormal(True)
        request.addfinalizer(lambda: torch.set_flush_denormal(False))
    divisor = comm.size if mean else 1
    with Reducer(comm, reproducible=True, mean=mean) as node, \
            Reducer(comm, reproducible=True, mean=mean, shared_memory=False) as mpi, \
            Reducer(comm) as plain:
        want = mpi.reduce(node_gradients(comm.rank, comm.size))
        assert mpi.backend == NAME
        got = node.reduce(node_gradients(comm.rank, comm.size))
        across = plain.uses_cross_memory and nodes(comm) == 1
        assert node.backend == (NODE_NAME if across else NAME)
        grads = node_gradients(comm.rank, comm.size)
        in_place = node.reduce(grads, inplace=True)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bitwise_equal(g, w, f"array {i}")
        assert in_place[i] is grads[i]
        assert_bitwise_equal(in_place[i], w, f"array {i} in place")
    small = exact_reference([node_gradients(r, comm.size)[2:] for r in range(comm.size)],
                            divisor)
    for i, w in enumerate(small):
        assert_bitwise_equal(got[2 + i], w, f"array {2 + i}: the reference")
    assert np.isnan(got[0][17]) and np.isnan(got[0][19]) == (comm.size > 1)
    assert got[0][13] == np.inf


def test_a_rank_without_the_one_pass_kernel_sends_every_rank_through_mpi(comm, monkeypatch):
    """Whether each rank can take the cross-memory pass (its C kernels) is agreed when
    the Reducer is made: one rank that cannot sends every rank's sums through MPI,
    with the same bits, and none waits for the others."""
    from mpigrad._base import exact as base_exact
    from mpigrad._engine.exact import NAME
    if comm.rank == 0:
        monkeypatch.setattr(base_exact, "sums_in_one_pass", lambda terms: False)
    with Reducer(comm, reproducible=True, mean=False) as reducer, \
            Reducer(comm, reproducible=True, mean=False, shared_memory=False) as mpi:
        got = reducer.reduce(node_gradients(comm.rank, comm.size))
        assert reducer.backend == NAME
        want = mpi.reduce(node_gradients(comm.rank, comm.size))
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bitwise_equal(g, w, f"array {i}")

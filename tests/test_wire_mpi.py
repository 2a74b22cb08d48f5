"""Reducer(wire="bfloat16"): float32 buckets travel as bfloat16 and are summed in float32.

Through MPI the result is known bit for bit from the rank count: each rank's addend rounded
once to bfloat16, the addends summed in float32 in rank order, the sum rounded once as
sum / 2^m (2^m the smallest power of two at least the rank count) and multiplied back: it
overflows the wire only where the addends' mean would. Across
nodes (node sums stay float32) the node sums are the addends: the result is within one
bfloat16 rounding of each addend and one of the result of the exact sum. Every rank gets the
same bits. A 200-step MLP trained through the wire ends within 1% of the float32 run."""

import ml_dtypes
import numpy as np
import pytest

from helpers import assert_bitwise_equal, assert_same_on_all_ranks, nodes
from mpigrad import Reducer

pytestmark = pytest.mark.mpi

SHAPES = [(1000,), (37, 41), (5,), (300_001,)]


def grads(rank, seed=0, dtype=np.float32):
    """Values over a wide exponent range, with cancellation: rounding shows."""
    rng = np.random.default_rng(100 * seed + rank)
    return [(rng.standard_normal(s) * 10.0 ** rng.integers(-6, 6, s)).astype(dtype)
            for s in SHAPES]


HALVES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
#: float16 tops at 65504: its wire's test values are scaled into its range
SCALES = {"bfloat16": 1.0, "float16": 1e-2}


def bf16(x):
    return rounded(x, "bfloat16")


def rounded(x, wire):
    return np.asarray(x, np.float32).astype(HALVES[wire]).astype(np.float32)


def spread(size):
    """The power of two the wire divides a sum by before rounding it (>= size)."""
    return np.float32(1 << (size - 1).bit_length())


def wire_sum(addends, wire):
    """The wire's sum of float32 ``addends`` (one per rank, in rank order)."""
    total = rounded(addends[0], wire)
    for addend in addends[1:]:
        total = total + rounded(addend, wire)
    k = spread(len(addends))
    return rounded(total / k, wire) * k


def wire_reference(size, seed=0, wire="bfloat16"):
    """The bits ``wire`` gives over ``size`` ranks (through MPI, mean=False)."""
    every = [[g * np.float32(SCALES[wire]) for g in grads(r, seed)] for r in range(size)]
    return [wire_sum([every[r][i] for r in range(size)], wire) for i in range(len(SHAPES))]


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_through_mpi_the_bits_are_known_from_the_rank_count(comm, wire):
    with Reducer(comm, wire=wire, mean=False, shared_memory=False,
                 bucket_bytes=64 << 10, chunk_bytes=256 << 10) as reducer:
        assert reducer.wire == wire
        mine = [g * np.float32(SCALES[wire]) for g in grads(comm.rank)]
        plain = reducer.reduce(mine)
        inplace = [g.copy() for g in mine]
        reducer.reduce(inplace, inplace=True)
        handle = reducer.start([g.copy() for g in mine])
        for i in reversed(range(len(SHAPES))):
            handle.ready(i)
        overlapped = handle.wait()
    for got in (plain, inplace, overlapped):
        for g, w in zip(got, wire_reference(comm.size, wire=wire)):
            assert_bitwise_equal(g, w.reshape(g.shape))


def test_the_mean_divides_the_wire_sum(comm):
    with Reducer(comm, wire="bfloat16", shared_memory=False) as reducer:
        out = reducer.reduce(grads(comm.rank, seed=1))
    every = [grads(r, 1) for r in range(comm.size)]
    for i, got in enumerate(out):
        total = wire_sum([every[r][i] for r in range(comm.size)], "bfloat16")
        assert_bitwise_equal(got, (total * np.float32(1.0 / comm.size)).reshape(got.shape))


#: per wire, each rank's value (rank, size): their sum passes the value where the
#: wire's rounding overflows (float16: 65520), their mean does not. (bfloat16's
#: range is float32's: a sum overflows it only where its 8-bit rounding passes
#: float32's largest too, as that sum, rounded, is not a float32 either.)
PAST_THE_WIRE = {"float16": lambda rank, size: 40000.0}


@pytest.mark.parametrize("wire", list(PAST_THE_WIRE))
@pytest.mark.parametrize("mean", [True, False])
def test_a_sum_past_the_wires_range_whose_mean_fits_stays_finite(comm, wire, mean):
    if comm.size == 1:
        pytest.skip("one rank sends nothing over the wire")
    every = [np.full(1000, PAST_THE_WIRE[wire](r, comm.size), np.float32)
             for r in range(comm.size)]
    with Reducer(comm, wire=wire, mean=mean, shared_memory=False, check_finite=True) as r:
        out = r.reduce([every[comm.rank]])[0]
        assert r.finite
    want = wire_sum(every, wire)
    if mean:
        want = want * np.float32(1.0 / comm.size)
    assert np.isfinite(want).all()
    assert_bitwise_equal(out, want)


@pytest.mark.parametrize("cross_memory", ["auto", False])     # False: shared buckets
def test_across_nodes_within_one_rounding_of_each_addend_and_of_the_result(comm, cross_memory):
    """With node sums where there are nodes, against float64's exact sum."""
    with Reducer(comm, wire="bfloat16", mean=False, cross_memory=cross_memory) as reducer:
        out = reducer.reduce(grads(comm.rank, seed=2))
        backend = reducer.backend
    with Reducer(comm, mean=False, cross_memory=cross_memory) as reducer:
        fp32 = reducer.reduce(grads(comm.rank, seed=2))
    if backend == "mpi" or nodes(comm) > 1:      # something crossed the wire: it rounded
        assert any(not np.array_equal(a, b) for a, b in zip(out, fp32))
    else:
        assert all(np.array_equal(a, b) for a, b in zip(out, fp32))
    every = [grads(r, 2) for r in range(comm.size)]
    u = 2.0 ** -8                    # bfloat16's unit roundoff
    for i, got in enumerate(out):
        exact = sum(e[i].astype(np.float64) for e in every)
        addends = sum(np.abs(e[i].astype(np.float64)) for e in every)
        # each addend (a rank's value or a node's float32 sum) rounded once, the result once,
        # plus float32's own summation error
        bound = u * addends + u * np.abs(exact) + 2.0 ** -22 * comm.size * addends
        err = np.abs(got.astype(np.float64) - exact)
        assert (err <= bound).all(), (backend, float((err - bound).max()))
    assert_same_on_all_ranks(comm, out)


def test_float64_buckets_are_not_touched(comm):
    with Reducer(comm, wire="bfloat16", mean=False) as reducer:
        doubles = [grads(comm.rank, 3, np.float64)[0]]
        got_doubles = reducer.reduce(doubles)[0]
    want = sum(grads(r, 3, np.float64)[0] for r in range(comm.size))
    np.testing.assert_allclose(got_doubles, want, rtol=1e-12, atol=1e-300)


def test_float16_gradients_never_travel_coarser_than_float16(comm):
    """float16 gradients are summed in float32 buckets; on the bfloat16 wire
    they would lose 3 bits of their own. A call that holds float16 gradients
    only takes the float16 wire; one that mixes them with float32 ones takes
    no wire (both known bit for bit from the rank count)."""
    def halves(rank):             # 11 significant bits: bfloat16 keeps 8 of them
        return (np.float32(rank + 1) * (1 + np.arange(1, 1000, dtype=np.float32) / 1024)
                ).astype(np.float16)
    every = [halves(r).astype(np.float32) for r in range(comm.size)]
    exact = sum(every)                          # float16 addends: exact in float32
    with Reducer(comm, wire="bfloat16", mean=False, shared_memory=False) as reducer:
        alone = reducer.reduce([halves(comm.rank)])[0]
        mixed = reducer.reduce([halves(comm.rank), np.full(7, comm.rank + 0.5, np.float32)])
    on_float16_wire = wire_sum(every, "float16").astype(np.float16)
    assert_bitwise_equal(alone, on_float16_wire)
    assert (wire_sum(every, "bfloat16").astype(np.float16) != alone).sum() > 500
    assert_bitwise_equal(mixed[0], exact.astype(np.float16))
    assert_bitwise_equal(mixed[1], np.full(7, sum(r + 0.5 for r in range(comm.size)),
                                           np.float32))


def test_bfloat16_gradients_never_take_the_float16_wire(comm):
    """bfloat16 gradients on the float16 wire would lose their range (1e6
    becomes inf) and be rounded twice: a call that holds them with float32
    ones takes no wire, one of them alone the bfloat16 wire (known bit for
    bit from the rank count); float32 gradients alone take the float16 wire."""
    def halves(rank):             # 8 significant bits, exponents -4..4, and 1e6
        steps = np.arange(1, 1000, dtype=np.float32)
        values = (1 + steps % 128 / 128) * np.exp2(steps % 9 - 4) * (rank + 1)
        values[::97] = 1e6 * (rank + 1)
        return values.astype(ml_dtypes.bfloat16)
    every = [halves(r).astype(np.float32) for r in range(comm.size)]
    exact = sum(every)                          # such addends: exact in float32
    mean = exact * np.float32(1 / comm.size)    # the mean in float32, then cast back
    floats = [np.full(7, comm.rank + 0.5, np.float32)]
    with Reducer(comm, wire="float16", shared_memory=False) as reducer:
        mixed = reducer.reduce([halves(comm.rank), *floats])
        alone = reducer.reduce([halves(comm.rank)])[0]
        on_float16 = reducer.reduce(floats)[0]
    assert_bitwise_equal(mixed[0], mean.astype(ml_dtypes.bfloat16))
    assert np.isfinite(mixed[0].astype(np.float32)).all()
    assert_bitwise_equal(mixed[1], np.full(7, sum(r + 0.5 for r in range(comm.size)) / comm.size,
                                           np.float32))
    on_bfloat16_wire = (wire_sum(every, "bfloat16") * np.float32(1 / comm.size))
    assert_bitwise_equal(alone, on_bfloat16_wire.astype(ml_dtypes.bfloat16))
    assert np.isfinite(alone.astype(np.float32)).all()
    floats_on_wire = wire_sum([np.full(7, r + 0.5, np.float32) for r in range(comm.size)],
                              "float16") * np.float32(1 / comm.size)
    assert_bitwise_equal(on_float16, floats_on_wire)


def test_mpigrad_wire_sets_the_default_wire(comm, monkeypatch):
    monkeypatch.setenv("MPIGRAD_WIRE", "bfloat16")
    with Reducer(comm, mean=False, shared_memory=False) as reducer:
        assert reducer.wire == "bfloat16"
        out = reducer.reduce(grads(comm.rank))
    for g, w in zip(out, wire_reference(comm.size)):
        assert_bitwise_equal(g, w.reshape(g.shape))
    monkeypatch.setenv("MPIGRAD_WIRE", "fp8")
    with pytest.raises(ValueError, match=r"MPIGRAD_WIRE: expecting one of \('bfloat16', "
                                         r"'float16'\) \(or unset\), got 'fp8'"):
        Reducer(comm)


def test_a_wire_other_ranks_do_not_use_raises_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("a communicator of size 1 has no other rank")
    with pytest.raises(Exception, match="wire"):
        Reducer(comm, wire="bfloat16" if comm.rank == 0 else None)
    with pytest.raises(ValueError, match=r"wire: expecting one of \(None, 'bfloat16', "
                                         r"'float16'\), got 'fp8'"):
        Reducer(comm, wire="fp8")


def _mlp_loss(comm, wire, steps=200):
    """A 2-layer MLP on a fixed regression task, data split across ranks; its final loss."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((512, 16)).astype(np.float32)
    y = np.sin(x @ rng.standard_normal((16, 1)).astype(np.float32))
    mine = slice(comm.rank * len(x) // comm.size, (comm.rank + 1) * len(x) // comm.size)
    w1 = (rng.standard_normal((16, 32)) / 4).astype(np.float32)
    w2 = (rng.standard_normal((32, 1)) / 6).astype(np.float32)
    with Reducer(comm, wire=wire) as reducer:
        for _ in range(steps):
            h = np.tanh(x[mine] @ w1)
            err = h @ w2 - y[mine]
            g2 = h.T @ err * (2 / len(x) * comm.size)
            g1 = x[mine].T @ ((err @ w2.T) * (1 - h * h)) * (2 / len(x) * comm.size)
            g1, g2 = reducer.reduce([g1, g2])
            w1 -= np.float32(0.1) * g1
            w2 -= np.float32(0.1) * g2
    return float(np.mean((np.tanh(x @ w1) @ w2 - y) ** 2))


def test_an_mlp_trained_through_the_wire_ends_within_one_percent_of_float32(comm):
    fp32, wire = _mlp_loss(comm, None), _mlp_loss(comm, "bfloat16")
    assert abs(wire - fp32) <= 0.01 * fp32, (fp32, wire)

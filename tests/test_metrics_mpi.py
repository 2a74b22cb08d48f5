"""mpigrad.allreduce for metrics and the Reducer's check_finite flag, against
references computed from the rank count. Run under mpiexec -n 2 and -n 3."""

from fractions import Fraction

import numpy as np
import pytest

import mpigrad
from helpers import assert_bitwise_equal, exactly_rounded, noisy, pattern
from mpigrad import PeerError, Reducer, StructureMismatchError

pytestmark = pytest.mark.mpi(min_size=2)


def test_python_numbers(comm):
    p, r = comm.size, comm.rank
    assert mpigrad.allreduce(r + 0.5, comm=comm) == sum(q + 0.5 for q in range(p)) / p
    total = mpigrad.allreduce(r + 1, op="sum", comm=comm)
    assert total == p * (p + 1) // 2 and type(total) is int
    assert mpigrad.allreduce(float(r), op="max", comm=comm) == p - 1
    assert mpigrad.allreduce(float(r), op="min", comm=comm) == 0.0
    assert type(mpigrad.allreduce(r, comm=comm)) is float


def test_accuracy_over_unequal_shards(comm):
    seen = 10 + 5 * comm.rank
    correct = seen // 2 + comm.rank
    counts = mpigrad.allreduce({"correct": correct, "seen": seen}, op="sum", comm=comm)
    want_correct = sum((10 + 5 * q) // 2 + q for q in range(comm.size))
    want_seen = sum(10 + 5 * q for q in range(comm.size))
    assert counts == {"correct": want_correct, "seen": want_seen}


def test_arrays_of_every_kind_keep_their_kind(comm):
    torch = pytest.importorskip("torch")
    tree = {"np": pattern((3,), np.float32, comm.rank, 0),
            "scalar": np.float64(comm.rank),
            "torch": torch.full((2,), float(comm.rank)),
            "bf16": torch.full((2,), float(comm.rank), dtype=torch.bfloat16),
            "ints": np.array([comm.rank, 1], np.int64)}
    out = mpigrad.allreduce(tree, op="sum", comm=comm)
    ranks = sum(range(comm.size))
    assert_bitwise_equal(out["np"], sum(pattern((3,), np.float32, q, 0)
                                        for q in range(comm.size)).astype(np.float32))
    assert isinstance(out["scalar"], np.float64) and out["scalar"] == ranks
    assert isinstance(out["torch"], torch.Tensor) and out["torch"].tolist() == [ranks] * 2
    assert out["bf16"].dtype == torch.bfloat16 and out["bf16"].tolist() == [ranks] * 2
    assert out["ints"].tolist() == [ranks, comm.size]
    mean = mpigrad.allreduce(np.array([comm.rank, 1], np.int64), comm=comm)
    assert mean.dtype == np.float64 and mean.tolist() == [ranks / comm.size, 1.0]


def test_jax_metric(comm):
    jax = pytest.importorskip("jax")
    out = mpigrad.allreduce(jax.numpy.asarray(float(comm.rank)), comm=comm)
    assert isinstance(out, jax.Array) and float(out) == sum(range(comm.size)) / comm.size


def test_mismatch_and_bad_input_raise_everywhere(comm):
    if comm.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    last = comm.rank == comm.size - 1
    with pytest.raises(StructureMismatchError):
        mpigrad.allreduce(np.zeros(3 if last else 2), comm=comm)
    # one rank's data rides on the agreement, the last one's (32 KiB) cannot
    with pytest.raises(StructureMismatchError):
        mpigrad.allreduce(np.zeros(1 << 12 if last else 2), comm=comm)
    assert mpigrad.allreduce(np.ones(2), comm=comm).tolist() == [1.0, 1.0]   # and it goes on
    with pytest.raises(StructureMismatchError):
        mpigrad.allreduce(1.0, op="max" if last else "sum", comm=comm)
    with pytest.raises(ValueError if last else PeerError, match="op|rank"):
        mpigrad.allreduce(1.0, op="median" if last else "sum", comm=comm)


def test_a_metric_translated_before_agrees_with_a_first_translation(comm):
    """A number or an array reduced before takes its kept translation: a rank
    on that path agrees with a rank translating it for the first time, each
    call sums its own values into a new array, and a rank that asks for
    another shape still raises on every rank."""
    from mpi4py import MPI
    p, r = comm.size, comm.rank
    x = np.arange(7.0) + r                        # float64[7]: no other test's signature
    if r == 0:                                    # translated here first, alone
        assert mpigrad.allreduce(x, op="sum", comm=MPI.COMM_SELF).tolist() == x.tolist()
        assert mpigrad.allreduce(2.5, op="max", comm=MPI.COMM_SELF) == 2.5
    for step in range(3):
        out = mpigrad.allreduce(x + step, op="sum", comm=comm)
        assert out.tolist() == sum(np.arange(7.0) + q + step for q in range(p)).tolist()
        assert mpigrad.allreduce(float(r + step), op="max", comm=comm) == p - 1 + step
        total = mpigrad.allreduce(r + step, op="sum", comm=comm)
        assert total == p * (p - 1) // 2 + p * step and type(total) is int
        assert mpigrad.allreduce(r + step, comm=comm) == (p - 1) / 2 + step
        scalar = mpigrad.allreduce(np.float32(r + step), op="sum", comm=comm)
        assert scalar == p * (p - 1) / 2 + p * step and type(scalar) is np.float32
        mean = mpigrad.allreduce(np.int32(r + step), comm=comm)          # not kept: a float64
        assert mean == (p - 1) / 2 + step and type(mean) is np.float64
    assert x.tolist() == (np.arange(7.0) + r).tolist()          # the caller's, untouched
    if p > 1:
        with pytest.raises(StructureMismatchError):
            mpigrad.allreduce(x if r == 0 else x[:6], op="sum", comm=comm)
        assert mpigrad.allreduce(x, op="sum", comm=comm)[0] == p * (p - 1) / 2
        # an int past int64 once ints were kept: no number dtype, refused everywhere
        with pytest.raises(TypeError if r == 0 else PeerError, match="value leaf 0|rank"):
            mpigrad.allreduce(2 ** 70 if r == 0 else r, op="sum", comm=comm)
        assert mpigrad.allreduce(r, op="sum", comm=comm) == p * (p - 1) // 2


def test_every_small_signature_agrees_through_the_one_exchange_and_plans_are_bounded(
        comm, monkeypatch):
    """The small calls of every signature carry their data in the communicator's one
    exchange (its slots shared: no plan holds slots of its own, so the ranks'
    agreements are one operation whatever they call); past its bound on plans the
    group forgets them all, and the next calls make them again, summing as before."""
    from mpigrad._collective import group as groups
    from mpigrad._collective.group import Group
    group = Group.shared(comm)
    exchange = group.communicator.exchange
    monkeypatch.setattr(groups, "_KEPT_PLANS", 3)
    group.plans.clear()
    for step in range(2):
        for n in range(1, 9):                    # 8 signatures: float64[1] .. float64[8]
            out = mpigrad.allreduce(np.full(n, comm.rank + step, np.float64), op="sum", comm=comm)
            assert out.tolist() == [sum(range(comm.size)) + comm.size * step] * n
            assert len(group.plans) <= 3
            carrying = [p.carrying[1] for p in group.plans.values() if p.carrying is not None]
            assert carrying and all(c.exchange is exchange for c in carrying)
    assert group.communicator.exchange is exchange


def test_small_calls_of_two_signatures_and_checked_calls_in_turn_each_agree_their_own(comm):
    """The exchange's slot is shared: a small call writes its header only where the slot
    holds another's. Two signatures in turn, a checked call (a broadcast) between, sum
    right; then one rank's second signature where the others repeat the first raises on
    every rank (its header, not the last one's, was sent)."""
    r, p = comm.rank, comm.size
    a, b = np.full(3, r + 1.0), np.full(5, r + 1, np.int64)
    for step in range(3):
        assert mpigrad.allreduce(a, op="sum", comm=comm).tolist() == [p * (p + 1) / 2] * 3
        assert mpigrad.allreduce(a, op="sum", comm=comm).tolist() == [p * (p + 1) / 2] * 3
        assert mpigrad.allreduce(b, op="max", comm=comm).tolist() == [p] * 5
        if step == 1:
            assert mpigrad.broadcast({"x": np.arange(4) * r}, comm=comm)["x"].tolist() == [0] * 4
    if p > 1:                                   # (one rank cannot disagree with itself)
        mpigrad.allreduce(a, op="sum", comm=comm)
        with pytest.raises(StructureMismatchError):
            mpigrad.allreduce(b if r == p - 1 else a, op="sum", comm=comm)
    assert mpigrad.allreduce(b, op="sum", comm=comm).tolist() == [p * (p + 1) // 2] * 5


def test_without_a_persistent_exchange_every_agreement_is_a_new_allgather(comm):
    """Where the MPI library has no persistent collectives (before MPI 4) the
    exchange has no request: each agreement starts a new Iallgather of its buffers,
    small calls carry their data, and a difference still raises on every rank."""
    from mpigrad._collective.group import Group
    from mpigrad.collectives import allreduce_on
    group = Group.over(comm, timeout=120)
    try:
        exchange = group.communicator.exchange
        exchange.free()                          # every rank: as a library without one
        assert exchange.request is None
        r, p = comm.rank, comm.size
        for _ in range(2):
            out = allreduce_on(group, np.full(4, r + 1.0), "sum")
            assert out.tolist() == [p * (p + 1) / 2] * 4
        if p > 1:
            with pytest.raises(StructureMismatchError):
                allreduce_on(group, np.zeros(4 + (r == 0)), "sum")
        assert allreduce_on(group, 2.0, "mean") == 2.0
    finally:
        group.free()


def test_a_kept_metric_follows_reproducible_set_between_its_calls(comm, monkeypatch):
    """A metric reduced before keeps its plan, but MPIGRAD_REPRODUCIBLE set
    between two calls (alike on every rank) still makes the next one the
    exact sum: ranks hold 1e8, 1.0, -1e8 in turn (at 3 ranks a float32 sum
    in rank order loses the 1.0), summed by the engine's exact path, whose
    MPI operations the carried small call does not make."""
    values = [1e8, 1.0, -1e8]
    mine = np.full(4, values[comm.rank % 3], np.float32)
    exact = exactly_rounded(Fraction(sum(values[q % 3] for q in range(comm.size))), np.float32)
    monkeypatch.delenv("MPIGRAD_REPRODUCIBLE", raising=False)
    mpigrad.allreduce(mine, op="sum", comm=comm)            # kept from here on
    costs, results = [], []
    for reproducible in ("0", "1", "1", "0"):
        monkeypatch.setenv("MPIGRAD_REPRODUCIBLE", reproducible)
        before = mpigrad.statistics()
        results.append(mpigrad.allreduce(mine, op="sum", comm=comm))
        costs.append((mpigrad.statistics() - before).operations)
    assert costs[0] == costs[3] < min(costs[1:3])
    for got in results[1:3]:
        assert_bitwise_equal(got, np.full(4, exact))


@pytest.mark.parametrize("elements", [4, 1 << 18], ids=["small", "1 MiB"])
@pytest.mark.parametrize("face", ["mpigrad.allreduce", "Reducer.allreduce"])
def test_a_bad_op_raises_on_every_rank_before_any_data_moves(comm, face, elements):
    """An op the table does not have (on one rank, then on every rank), for a
    small call and one of the engine's size: ValueError naming the ops where
    it was asked, PeerError naming that rank elsewhere, from the agreement
    (then the error reports: mpigrad.statistics counts no operation of the
    data's, nor its bytes), the arrays unchanged; the next call is right."""
    last = comm.rank == comm.size - 1
    values = np.full(elements, comm.rank + 1.0, np.float32)
    with Reducer(comm, mean=False) as reducer:
        call = {"mpigrad.allreduce": lambda op: mpigrad.allreduce(values, op=op, comm=comm),
                "Reducer.allreduce": lambda op: reducer.allreduce(values, op=op)}[face]
        for bad_here in (last, True):
            before = mpigrad.statistics()
            error = ValueError if bad_here else PeerError
            with pytest.raises(error, match="expecting one of the ops" if bad_here else
                               rf"rank {comm.size - 1}"):
                call("median" if bad_here else "sum")
            cost = mpigrad.statistics() - before
            assert cost.agreements == 1 and cost.operations <= 3 and cost.moved < 64 << 10
            assert (values == comm.rank + 1.0).all()
        assert (call("sum") == comm.size * (comm.size + 1) / 2).all()


@pytest.mark.parametrize("where", ["none", "own memory", "packed half", "overflow", "sparse"])
@pytest.mark.parametrize("path", ["reduce", "inplace", "overlap"])
def test_check_finite_is_agreed_when_one_rank_overflows(comm, where, path):
    from mpigrad import RowSparse
    bad = comm.rank == comm.size - 1
    big = pattern((1 << 18,), np.float32, comm.rank, 0)            # its own bucket
    small = pattern((5,), np.float16, comm.rank, 1)                # packed, cast back
    values = np.ones((1, 2), np.float32)
    if bad and where == "own memory":
        big[7] = np.inf
    if bad and where == "packed half":
        small[2] = np.nan
    if where == "overflow":                 # finite on every rank, inf once summed in fp16
        small[3] = 60000
    if bad and where == "sparse":
        values[0, 1] = -np.inf
    grads = [big, small, RowSparse(np.array([0]), values, (3, 2))]
    with Reducer(comm, mean=False, check_finite=True) as reducer:
        if path == "overlap":
            handle = reducer.start(grads[:2])
            handle.ready(1)
            handle.wait()
            finite_expected = where in ("none", "sparse") or (where == "overflow"
                                                               and comm.size == 1)
        else:
            reducer.reduce(grads, inplace=path == "inplace")
            finite_expected = where == "none" or (where == "overflow" and comm.size == 1)
        flags = comm.allgather(reducer.finite)
    assert flags == [finite_expected] * comm.size


def test_finite_is_none_without_check_finite(comm):
    with Reducer(comm) as reducer:
        reducer.reduce([np.ones(3)])
        assert reducer.finite is None and not reducer.check_finite


def test_the_mean_of_complex_values_scales_each_part(comm):
    # one mean for every path: a real factor, as the Reducer's (inf+1j times
    # (1/p + 0j) would give inf+nanj)
    value = np.array([complex(np.inf, 1.0), 2 + 4j], np.complex128)
    mean = mpigrad.allreduce(value, comm=comm)
    assert mean[0].real == np.inf and mean[0].imag == comm.size * (1.0 / comm.size)
    with Reducer(comm) as reducer:
        (reduced,) = reducer.reduce([value])
    assert_equal = np.testing.assert_array_equal
    assert_equal(reduced, mean)


@pytest.mark.parametrize("bad", [None, "abc", object()])
def test_a_bad_value_on_one_rank_is_an_error_everywhere_and_the_next_calls_are_right(comm, bad):
    if comm.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    last = comm.rank == comm.size - 1
    with pytest.raises(TypeError if last else PeerError,
                       match="value leaf 0: expecting a number|rank"):
        mpigrad.allreduce(bad if last else 1.0, op="sum", comm=comm)
    assert mpigrad.allreduce(10.0, op="sum", comm=comm) == 10.0 * comm.size
    assert mpigrad.allreduce(1.0, comm=comm) == 1.0


def test_max_and_min_of_bools(comm):
    last = comm.rank == comm.size - 1
    assert mpigrad.allreduce(last, op="max", comm=comm) is True
    assert mpigrad.allreduce(last, op="min", comm=comm) is (comm.size == 1)
    flags = mpigrad.allreduce(np.array([last, True]), op="min", comm=comm)
    assert flags.dtype == np.bool_ and flags.tolist() == [comm.size == 1, True]


def test_allgather_object_in_rank_order(comm):
    got = mpigrad.allgather_object({"rank": comm.rank, "rows": list(range(comm.rank))},
                                   comm=comm)
    assert got == [{"rank": q, "rows": list(range(q))} for q in range(comm.size)]


def test_allgather_object_unpicklable_on_one_rank_raises_everywhere(comm):
    last = comm.rank == comm.size - 1
    obj = (lambda: 0) if last else 0
    with pytest.raises(TypeError if last else PeerError, match="picklable|rank"):
        mpigrad.allgather_object(obj, comm=comm)
    assert mpigrad.allgather_object(comm.rank, comm=comm) == list(range(comm.size))


def test_a_reproducible_reducers_allreduce_is_the_exact_sum(comm):
    """Ranks hold 1e8, 1.0, -1e8 (in turn): a float32 sum in rank order
    loses the 1.0; the Reducer's exact sum, rounded once, keeps it."""
    values = [1e8, 1.0, -1e8]
    mine = np.full(1 << 19, values[comm.rank % 3], np.float32)          # 2 MiB
    with Reducer(comm, reproducible=True, mean=False) as reducer:
        total = reducer.allreduce(mine, op="sum")
        mean = reducer.allreduce(mine, op="mean")
    exact = Fraction(sum(values[q % 3] for q in range(comm.size)))
    assert_bitwise_equal(total, np.full(mine.size, exactly_rounded(exact, np.float32)))
    assert_bitwise_equal(mean, np.full(mine.size, exactly_rounded(exact / comm.size,
                                                                   np.float32)))


@pytest.mark.parametrize("elements", [256, 1 << 19], ids=["1KiB", "2MiB"])
@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("settings", [{}, {"shared_memory": False}, {"reproducible": True},
                                      {"wire": "bfloat16"}, {"wire": "float16"}],
                         ids=["default", "through MPI", "reproducible", "bf16 wire",
                              "fp16 wire"])
def test_a_reducers_allreduce_has_the_bits_of_its_own_reduce(comm, settings, mean, elements):
    """Every setting that changes bits (exact sums, the wire, node and
    cross-memory sums) gives a Reducer's allreduce the bits of its reduce."""
    dtype = np.float16 if settings.get("wire") == "float16" else np.float32   # in its range
    mine = noisy((elements,), dtype, comm.rank, seed=elements).astype(np.float32)
    with Reducer(comm, mean=mean, **settings) as reducer:
        got = reducer.allreduce(mine, op="mean" if mean else "sum")
        want = reducer.reduce([mine])[0]
    assert_bitwise_equal(got, want)


def test_a_reducers_collectives_run_on_its_own_engine(comm, monkeypatch):
    """allreduce, broadcast and allgather_object of a Reducer make no Engine
    of their own (one Engine per Reducer)."""
    from mpigrad._engine.engine import Engine
    made = []
    construct = Engine.__init__

    def counted(self, *args, **kwargs):
        made.append(args)
        construct(self, *args, **kwargs)
    with Reducer(comm, mean=False) as reducer:
        monkeypatch.setattr(Engine, "__init__", counted)
        total = reducer.allreduce(np.ones(1 << 19, np.float32), op="mean")
        shared = reducer.broadcast([np.full(3, comm.rank, np.float32)], root=0)
        ranks = reducer.allgather_object(comm.rank)
    assert made == []
    assert total.tolist() == [1.0] * (1 << 19) and shared[0].tolist() == [0.0] * 3
    assert ranks == list(range(comm.size))

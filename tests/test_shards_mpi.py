"""reduce_scatter / allgather_shards: each rank's shard of the mean against the
numpy reference, the round trip into full arrays, every element owned by
exactly one rank, and errors on every rank. Run under mpiexec -n 2 and -n 3
(and at 4 ranks as 2 nodes of 2)."""

import numpy as np
import pytest

from helpers import ALL_DTYPES, assert_bitwise_equal, expected, pattern
from mpigrad import PeerError, Reducer, RowSparse, StructureMismatchError
from mpigrad._base.dtypes import wire_dtype

pytestmark = pytest.mark.mpi(min_size=2)

# sizes not divisible by 2 or 3, one smaller than the ranks, a scalar
SHAPES = [(40, 7), (5,), (1,), (), (333,)]


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


# on one node holding every rank: cross-memory (the default) and MPI
BACKENDS = {"auto": {}, "mpi": {"cross_memory": False}}


def last(comm):
    return comm.rank == comm.size - 1


def grads_of(comm, dtype, shapes=SHAPES):
    return [pattern(s, dtype, comm.rank, i) for i, s in enumerate(shapes)]


def reference_shard(comm, reducer, grads, dtype, mean, rank=None):
    """{wire dtype: the shard ``rank`` should receive}, from the numpy reference."""
    want = {}
    for wire, ranges in reducer.shards(grads, rank).items():
        parts = [expected(SHAPES[i], dtype, comm.size, i, mean=mean).astype(wire).ravel()[a:b]
                 for i, a, b in ranges]
        want[wire] = np.concatenate(parts) if parts else np.empty(0, wire)
    return want


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
def test_each_rank_receives_its_shard_and_the_round_trip_gives_the_mean(comm, dtype, mean,
                                                                         backend):
    with Reducer(comm, mean=mean, bucket_bytes=200, **BACKENDS[backend]) as reducer:
        grads = grads_of(comm, dtype)
        shards = reducer.reduce_scatter(grads)
        want = reference_shard(comm, reducer, grads, dtype, mean)
        assert set(shards) == {wire_dtype(dtype)}
        for wire, shard in shards.items():
            # half precision: the mean in float32, as reduce computes it before the cast
            if wire == dtype:
                assert_bitwise_equal(shard, want[wire], f"{wire} shard")
            else:
                assert np.allclose(shard, want[wire], rtol=1e-2, atol=1e-2)
        for g, fresh in zip(grads, grads_of(comm, dtype)):      # not written
            assert_bitwise_equal(g, fresh)
        into = [np.full(s, 7, dtype) for s in SHAPES]
        out = reducer.allgather_shards(shards, into)
        assert all(o is i for o, i in zip(out, into))            # in place
        for i, s in enumerate(SHAPES):
            assert_bitwise_equal(into[i], expected(s, dtype, comm.size, i, mean=mean),
                                 f"gradient {i}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
def test_shards_written_past_the_cache_are_the_same_shards(comm, dtype, monkeypatch):
    """Every cross-memory shard streamed (fused_sum's stream, at any size here): the
    same bits as the reference."""
    from mpigrad._backends import cross_memory
    monkeypatch.setattr(cross_memory, "_STREAM_BYTES", 0)
    dtype = np.dtype(dtype)
    with Reducer(comm, bucket_bytes=200) as reducer:
        grads = grads_of(comm, dtype)
        shards = reducer.reduce_scatter(grads)
        want = reference_shard(comm, reducer, grads, dtype, True)
        for wire, shard in shards.items():
            if wire == dtype:
                assert_bitwise_equal(shard, want[wire], f"{wire} shard")
            else:
                assert np.allclose(shard, want[wire], rtol=1e-2, atol=1e-2)


def owned_only(comm, reducer, arrays, full, rank=None):
    """Copies of ``arrays`` holding ``full``'s values at the elements ``rank``
    (default this rank) owns, -1 elsewhere."""
    mine = [np.full_like(a, -1) for a in arrays]
    for _, ranges in reducer.shards(arrays, rank).items():
        for i, a, b in ranges:
            flat = mine[i].reshape(-1)          # C order, as the shards count
            flat[a:b] = np.asarray(full[i]).reshape(-1)[a:b]
            mine[i][...] = flat.reshape(mine[i].shape)
    return mine


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_allgather_of_shards_already_in_place(comm, backend):
    """shards=None: each rank updated its own elements of the arrays; the
    others' are gathered into them. float16 arrays (staged: cast to float32
    on the wire) and Fortran-ordered ones beside float32 and float64."""
    shapes = [(40, 7), (5,), (1,), (), (333,), (6, 5), (3, 4)]
    dtypes = [np.float32, np.float32, np.float64, np.float32, np.float16, np.float32,
              np.float64]
    full = [pattern(s, d, 9, i) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    full[5] = np.asfortranarray(full[5])
    with Reducer(comm, bucket_bytes=300, **BACKENDS[backend]) as reducer:
        into = owned_only(comm, reducer, full, full)
        into[5] = np.asfortranarray(into[5])
        out = reducer.allgather_shards(None, into)
        assert all(o is i for o, i in zip(out, into))
        for i, (got, want) in enumerate(zip(into, full)):
            assert_bitwise_equal(got, want, f"array {i}")
        assert into[5].flags.f_contiguous


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_reduce_scatter_of_mixed_and_strided_gradients(comm, backend):
    """Gradients the node sum reads as they are beside ones it must stage:
    half precision, Fortran order, a strided view."""
    base = [pattern((40, 7), np.float32, comm.rank, 0), pattern((5,), np.float16, comm.rank, 1),
            pattern((6, 5), np.float32, comm.rank, 2), pattern((9, 4), np.float32, comm.rank, 3)]
    grads = [base[0], base[1], np.asfortranarray(base[2]), base[3][:, ::2]]
    shapes = [(40, 7), (5,), (6, 5), (9, 4)]
    dtypes = [np.float32, np.float16, np.float32, np.float32]
    with Reducer(comm, bucket_bytes=100, **BACKENDS[backend]) as reducer:
        shards = reducer.reduce_scatter(grads)
        for wire, ranges in reducer.shards(grads).items():
            parts = []
            for i, a, b in ranges:
                whole = expected(shapes[i], dtypes[i], comm.size, i).astype(wire)
                parts.append((whole[:, ::2] if i == 3 else whole).ravel()[a:b])
            want = np.concatenate(parts) if parts else np.empty(0, wire)
            assert np.allclose(shards[wire], want, rtol=1e-3, atol=1e-3)
            if not any(dtypes[i] == np.float16 for i, _, _ in ranges):
                assert_bitwise_equal(shards[wire], want.astype(wire))


def test_every_element_is_owned_by_exactly_one_rank_in_balanced_ranges(comm):
    grads = [np.zeros(s, np.float32) for s in SHAPES] + [np.zeros(9, np.float64)]
    with Reducer(comm, split_indices=[2], skip=[False, True, False, False, False, False]) \
            as reducer:
        count = [np.zeros(g.size, int) for g in grads]
        totals = {}
        for rank in range(comm.size):
            for wire, ranges in reducer.shards(grads, rank).items():
                totals.setdefault(wire, []).append(sum(b - a for _, a, b in ranges))
                for i, a, b in ranges:
                    count[i][a:b] += 1
        assert all((c == (0 if i == 1 else 1)).all() for i, c in enumerate(count))
        assert all(max(t) - min(t) <= 1 for t in totals.values())
        shards = reducer.reduce_scatter(grads)
        assert {w: s.size for w, s in shards.items()} == \
            {w: t[comm.rank] for w, t in totals.items()}


def test_finite_flag_covers_every_shard(comm):
    with Reducer(comm, check_finite=True) as reducer:
        grads = [np.ones(1000, np.float32)]
        if last(comm):
            grads[0][3] = np.inf          # in rank 0's shard, put there by the last rank
        reducer.reduce_scatter(grads)
        assert reducer.finite is False
        reducer.reduce_scatter([np.ones(1000, np.float32)])
        assert reducer.finite is True


def test_structure_mismatch_sparse_and_bad_shards_raise_everywhere(comm):
    with Reducer(comm) as reducer:
        grads = grads_of(comm, np.float32)
        with pytest.raises(StructureMismatchError, match="number of gradients differs"):
            reducer.reduce_scatter(grads[:-1] if last(comm) else grads)
        sparse = [grads[0], RowSparse(np.array([0]), np.ones((1, 3), np.float32), (4, 3))]
        with pytest.raises(TypeError if last(comm) else PeerError,
                           match="RowSparse gradients have no element shards"):
            reducer.reduce_scatter(sparse if last(comm) else grads[:1] + [np.ones((4, 3))])
        shards = reducer.reduce_scatter(grads)
        into = [np.full(s, 7, np.float32) for s in SHAPES]
        bad = {np.dtype(np.float32): shards[np.dtype(np.float32)][:-1]} if last(comm) else shards
        with pytest.raises(ValueError if last(comm) else PeerError,
                           match=r"shards\[float32\]: expecting this rank's float32"):
            reducer.allgather_shards(bad, into)
        assert all((i == 7).all() for i in into)           # nothing written
        reducer.allgather_shards(shards, into)
        assert_bitwise_equal(into[0], expected(SHAPES[0], np.float32, comm.size, 0))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_shard_kept_is_not_overwritten_by_the_next_call(comm, backend):
    with Reducer(comm, **BACKENDS[backend]) as reducer:
        first = reducer.reduce_scatter(grads_of(comm, np.float32))
        kept = {w: s.copy() for w, s in first.items()}
        second = reducer.reduce_scatter([np.asarray(g * 2) for g in grads_of(comm, np.float32)])
        for wire in kept:
            assert_bitwise_equal(first[wire], kept[wire])
            assert_bitwise_equal(second[wire], kept[wire] * 2)
        del first
        reducer.reduce_scatter(grads_of(comm, np.float32))
        for wire in kept:                     # (the second call's still held)
            assert_bitwise_equal(second[wire], kept[wire] * 2)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=lambda d: d.__name__)
def test_overlapped_reduce_scatter_equals_the_blocking_one(comm, backend, dtype):
    """start_reduce_scatter, gradients marked in a different order on each
    rank (backward's order differs): each bucket goes out once complete, in
    the same order everywhere; the shards equal reduce_scatter's bitwise."""
    with Reducer(comm, bucket_bytes=64, check_finite=True, **BACKENDS[backend]) as reducer:
        grads = grads_of(comm, dtype)
        want = reducer.reduce_scatter(grads)
        want = {w: s.copy() for w, s in want.items()}
        pending = reducer.start_reduce_scatter(grads, agree={"step": 1})
        order = list(range(len(grads)))
        np.random.default_rng(comm.rank).shuffle(order)
        for index in order:
            pending.ready(index)
        with pytest.raises(ValueError, match="already marked"):
            pending.ready(order[0])
        got = pending.wait()
        assert reducer.finite is True
        for wire in want:
            assert_bitwise_equal(got[wire], want[wire], f"{wire} shard")
        with pytest.raises(RuntimeError, match="already finished"):
            pending.wait()
        # ready() need not be called: wait() launches what is left
        got = reducer.start_reduce_scatter(grads).wait()
        for wire in want:
            assert_bitwise_equal(got[wire], want[wire], f"{wire} shard")


def test_overlapped_reduce_scatter_mismatch_raises_everywhere(comm):
    with Reducer(comm, cross_memory=False) as reducer:
        grads = grads_of(comm, np.float32)
        with pytest.raises(StructureMismatchError, match="number of gradients differs"):
            reducer.start_reduce_scatter(grads[:-1] if last(comm) else grads)
        pending = reducer.start_reduce_scatter(grads)
        with pytest.raises(StructureMismatchError, match="step"):
            pending.wait(agree={"step": comm.rank})
        got = reducer.start_reduce_scatter(grads).wait()        # the next call works
        for wire, shard in reference_shard(comm, reducer, grads, np.float32, True).items():
            assert_bitwise_equal(got[wire], shard)

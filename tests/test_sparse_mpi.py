"""Collective tests of row-sparse reduction; run under mpiexec -n 2 and -n 3."""

import numpy as np
import pytest

from helpers import assert_bitwise_equal, assert_same_on_all_ranks, expected, pattern, sparse_rows
from mpigrad import Reducer, RowSparse
from mpigrad.dtypes import bfloat16, wire_dtype

pytestmark = pytest.mark.mpi(min_size=2)

HALF_AND_FULL = [np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64)]


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def make(rank, seed, rows, ks, width, dtype, index_dtype=np.int64):
    return RowSparse(*sparse_rows(rank, seed, rows, ks[rank % len(ks)], width, dtype,
                                  index_dtype), (rows, *width))


def gather_reference(size, seed, rows, ks, width, dtype, index_dtype, mean, degree=None):
    parts = [sparse_rows(r, seed, rows, ks[r % len(ks)], width, dtype, index_dtype)
             for r in range(size)]
    indices = np.concatenate([p[0] for p in parts]).astype(index_dtype)
    wire = wire_dtype(dtype)
    values = np.concatenate([p[1].astype(wire) for p in parts]).reshape(-1, *width)
    if mean:
        values = values * wire.type(1.0 / (degree or size))
    return indices, values.astype(dtype)


def dense_reference(size, seed, rows, ks, width, dtype, index_dtype, mean):
    """Reduced dense matrix, and the sorted rows any rank touched."""
    wire = wire_dtype(dtype)
    total = np.zeros((rows, *width), wire)
    touched = []
    for r in range(size):
        idx, val = sparse_rows(r, seed, rows, ks[r % len(ks)], width, dtype, index_dtype)
        np.add.at(total, idx, val.astype(wire))
        touched.append(idx)
    if mean:
        total = total * wire.type(1.0 / size)
    return total.astype(dtype), np.unique(np.concatenate(touched))


def assert_sparse_same_on_all_ranks(comm, results):
    assert_same_on_all_ranks(comm, [a for r in results for a in (r.indices, r.values)])


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=lambda d: d.name)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
def test_gather_keeps_every_ranks_rows_in_rank_order(comm, dtype, index_dtype, mean):
    ks, width, rows = [3, 0, 5], (4,), 10
    grad = make(comm.rank, 1, rows, ks, width, dtype, index_dtype)
    with Reducer(sparse="gather", mean=mean) as reducer:
        (out,) = reducer.reduce([grad])
    want_idx, want_val = gather_reference(comm.size, 1, rows, ks, width, dtype, index_dtype,
                                          mean)
    assert isinstance(out, RowSparse) and out.dense_shape == (rows, *width)
    assert_bitwise_equal(out.indices, want_idx, "indices")
    assert_bitwise_equal(out.values, want_val, "values")
    assert_sparse_same_on_all_ranks(comm, [out])


@pytest.mark.parametrize("mode", ["gather", "dense", "auto"])
def test_all_ranks_empty(comm, mode):
    grad = RowSparse(np.zeros(0, np.int32), np.zeros((0, 3), np.float16), (5, 3))
    with Reducer(sparse=mode) as reducer:
        (out,) = reducer.reduce([grad])
    assert out.nnz == 0 and out.values.dtype == np.float16 and out.indices.dtype == np.int32
    assert not out.to_dense().any()


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=lambda d: d.name)
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
def test_dense_mode_returns_coalesced_touched_rows(comm, dtype, mean):
    ks, width, rows = [6, 0, 2], (3, 2), 12
    grad = make(comm.rank, 2, rows, ks, width, dtype)
    with Reducer(sparse="dense", mean=mean) as reducer:
        (out,) = reducer.reduce([grad])
    dense, touched = dense_reference(comm.size, 2, rows, ks, width, dtype, np.int64, mean)
    assert_bitwise_equal(out.indices, touched, "indices")
    assert_bitwise_equal(out.values, dense[touched], "values")
    assert_bitwise_equal(out.to_dense(), dense, "to_dense")
    assert_sparse_same_on_all_ranks(comm, [out])


def test_auto_takes_both_decisions_and_agrees_with_dense_allreduce(comm):
    # few rows of a big table: gathered; many rows of a tiny table: densified
    few = make(comm.rank, 3, 1000, [2, 1, 3], (8,), np.float32)
    many = make(comm.rank, 4, 3, [40, 50, 60], (8,), np.float32)
    with Reducer(sparse="auto", mean=False) as reducer:
        out_few, out_many = reducer.reduce([few, many])
        dense_few, dense_many = reducer.reduce([few.to_dense(), many.to_dense()])
    assert out_few.nnz == sum([2, 1, 3][r % 3] for r in range(comm.size))   # gathered
    assert out_many.nnz <= 3 and np.all(np.diff(out_many.indices) > 0)       # densified
    assert_bitwise_equal(out_few.to_dense(), dense_few)
    assert_bitwise_equal(out_many.to_dense(), dense_many)


def test_mixed_dense_and_several_sparse_dtypes(comm):
    ks = [4, 1, 0]
    grads = [pattern((5, 3), np.float32, comm.rank, 0),
             make(comm.rank, 5, 20, ks, (3,), np.float16),
             pattern((7,), np.float64, comm.rank, 2),
             make(comm.rank, 6, 9, ks, (), np.float64, np.int32),
             make(comm.rank, 7, 15, [2, 3, 1], (2,), bfloat16),
             make(comm.rank, 8, 20, [0, 2, 2], (3,), np.float32)]
    with Reducer(sparse="gather") as reducer:
        plan = reducer.plan(grads)
        out = reducer.reduce(grads, inplace=True)
    assert [b.indices for b in plan.buckets] == [(0,), (2,)]
    assert sorted(g.indices for g in plan.sparse) == [(1, 4, 5), (3,)]
    assert_bitwise_equal(grads[0], expected((5, 3), np.float32, comm.size, 0))
    assert_bitwise_equal(grads[2], expected((7,), np.float64, comm.size, 2))
    specs = {1: (5, 20, ks, (3,), np.float16, np.int64), 3: (6, 9, ks, (), np.float64, np.int32),
             4: (7, 15, [2, 3, 1], (2,), bfloat16, np.int64),
             5: (8, 20, [0, 2, 2], (3,), np.float32, np.int64)}
    for i, (seed, rows, k, width, dtype, idt) in specs.items():
        assert out[i] is not grads[i]                 # sparse inputs left alone
        want_idx, want_val = gather_reference(comm.size, seed, rows, k, width, dtype, idt,
                                              True)
        assert_bitwise_equal(out[i].indices, want_idx, f"indices {i}")
        assert_bitwise_equal(out[i].values, want_val, f"values {i}")
    original = make(comm.rank, 5, 20, ks, (3,), np.float16)
    assert_bitwise_equal(grads[1].values, original.values)
    assert_sparse_same_on_all_ranks(comm, [out[i] for i in specs])


def test_skip_applies_to_sparse(comm):
    grads = [make(comm.rank, 9, 6, [1, 2], (2,), np.float32), pattern((3,), np.float32,
                                                                      comm.rank, 1)]
    with Reducer(skip=[True, False]) as reducer:
        out = reducer.reduce(grads)
        assert reducer.plan(grads).sparse == ()
    assert out[0] is grads[0]
    assert_bitwise_equal(out[1], expected((3,), np.float32, comm.size, 1))

"""Collective tests of row-sparse reduction; run under mpiexec -n 2 and -n 3."""

import numpy as np
import pytest

from helpers import (assert_bitwise_equal, assert_same_on_all_ranks, expected, noisy, pattern,
                     smallest_subnormal, sparse_rows, unit_roundoff)
from mpigrad import Reducer, RowSparse
from mpigrad._base.dtypes import bfloat16, wire_dtype

pytestmark = pytest.mark.mpi(min_size=2)

HALF_AND_FULL = [np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64)]


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


def dense_reference(size, seed, rows, ks, width, dtype, index_dtype, mean, degree=None):
    """Reduced dense matrix, and the sorted rows any rank touched."""
    wire = wire_dtype(dtype)
    total = np.zeros((rows, *width), wire)
    touched = []
    for r in range(size):
        idx, val = sparse_rows(r, seed, rows, ks[r % len(ks)], width, dtype, index_dtype)
        np.add.at(total, idx, val.astype(wire))
        touched.append(idx)
    if mean:
        total = total * wire.type(1.0 / (degree or size))
    return total.astype(dtype), np.unique(np.concatenate(touched))


def assert_sparse_same_on_all_ranks(comm, results):
    assert_same_on_all_ranks(comm, [a for r in results for a in (r.indices, r.values)])


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=lambda d: d.name)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
def test_gather_keeps_every_ranks_rows_in_rank_order(comm, dtype, index_dtype, mean):
    ks, width, rows = [3, 0, 5], (4,), 10
    grad = make(comm.rank, 1, rows, ks, width, dtype, index_dtype)
    with Reducer(comm, sparse="gather", mean=mean) as reducer:
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
    with Reducer(comm, sparse=mode) as reducer:
        (out,) = reducer.reduce([grad])
    assert out.nnz == 0 and out.values.dtype == np.float16 and out.indices.dtype == np.int32
    assert not out.to_dense().any()


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=lambda d: d.name)
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
def test_dense_mode_returns_coalesced_touched_rows(comm, dtype, mean):
    ks, width, rows = [6, 0, 2], (3, 2), 12
    grad = make(comm.rank, 2, rows, ks, width, dtype)
    with Reducer(comm, sparse="dense", mean=mean) as reducer:
        (out,) = reducer.reduce([grad])
    dense, touched = dense_reference(comm.size, 2, rows, ks, width, dtype, np.int64, mean)
    assert_bitwise_equal(out.indices, touched, "indices")
    assert_bitwise_equal(out.values, dense[touched], "values")
    assert_bitwise_equal(out.to_dense(), dense, "to_dense")
    assert_sparse_same_on_all_ranks(comm, [out])


def test_auto_takes_both_decisions(comm):
    # few rows of a big table: gathered; many rows of a tiny table: densified
    # (a communicator of size 1 moves nothing either way, and densifies)
    ks_few, ks_many = [2, 1, 3], [40, 50, 60]
    few = make(comm.rank, 3, 1000, ks_few, (8,), np.float32)
    many = make(comm.rank, 4, 3, ks_many, (8,), np.float32)
    with Reducer(comm, sparse="auto", mean=False) as reducer:
        out_few, out_many = reducer.reduce([few, many])
    if comm.size > 1:
        want_idx, want_val = gather_reference(comm.size, 3, 1000, ks_few, (8,), np.float32,
                                              np.int64, False)
        assert_bitwise_equal(out_few.indices, want_idx, "gathered indices")
        assert_bitwise_equal(out_few.values, want_val, "gathered values")
    else:
        dense, touched = dense_reference(1, 3, 1000, ks_few, (8,), np.float32, np.int64, False)
        assert_bitwise_equal(out_few.indices, touched, "densified indices")
    dense, touched = dense_reference(comm.size, 4, 3, ks_many, (8,), np.float32, np.int64,
                                     False)
    assert_bitwise_equal(out_many.indices, touched, "densified indices")
    assert_bitwise_equal(out_many.values, dense[touched], "densified values")


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=lambda d: d.name)
@pytest.mark.parametrize("mean, degree", [(False, None), (True, 4)], ids=["sum", "mean-by-4"])
def test_gathered_and_densified_to_dense_are_bitwise_equal_when_exact(comm, dtype, mean,
                                                                      degree):
    """docs/semantics.md: equal bitwise when every sum and every scaled value is exact in
    the gradient dtype (small integers, a sum or a power-of-two degree)."""
    ks, width, rows = [7, 2, 5], (3,), 6          # duplicates within and across ranks
    grad = make(comm.rank, 11, rows, ks, width, dtype)
    results = {}
    for mode in ("gather", "dense"):
        with Reducer(comm, sparse=mode, mean=mean, degree=degree) as reducer:
            results[mode] = reducer.reduce([grad])[0].to_dense()
    assert_bitwise_equal(results["gather"], results["dense"], "gathered vs densified")
    want, _ = dense_reference(comm.size, 11, rows, ks, width, dtype, np.int64, mean, degree)
    assert_bitwise_equal(results["dense"], want, "densified vs numpy")


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=lambda d: d.name)
def test_gathered_and_densified_to_dense_differ_by_rounding_only(comm, dtype):
    """docs/semantics.md: otherwise they differ by at most (2n + 5) u sum|x| / degree per
    element, n the rows summed into it, u the unit roundoff of the gradient
    dtype (the gathered values are rounded row by row, the densified once)."""
    ks, width, rows = [9, 4, 6], (5,), 4
    parts = [(np.random.default_rng([12, r]).integers(0, rows, ks[r % 3]),
              noisy((ks[r % 3], *width), dtype, r, 12)) for r in range(comm.size)]
    idx, val = parts[comm.rank]
    grad = RowSparse(idx, val, (rows, *width))
    results = {}
    for mode in ("gather", "dense"):
        with Reducer(comm, sparse=mode) as reducer:
            results[mode] = reducer.reduce([grad])[0].to_dense().astype(np.float64)
    magnitude = np.zeros((rows, *width))
    count = np.zeros(rows)
    for i, v in parts:
        np.add.at(magnitude, i, np.abs(v.astype(np.float64)))
        np.add.at(count, i, 1)
    n = count.reshape(rows, *[1] * len(width))
    u, sub = unit_roundoff(dtype), smallest_subnormal(dtype)
    bound = ((2 * n + 5) * u * magnitude / comm.size + (n + 2) * sub) * 1.001
    error = np.abs(results["gather"] - results["dense"])
    assert (error <= bound).all(), f"worst excess {(error - bound).max()!r}"


def test_mixed_dense_and_several_sparse_dtypes(comm):
    ks = [4, 1, 0]
    grads = [pattern((5, 3), np.float32, comm.rank, 0),
             make(comm.rank, 5, 20, ks, (3,), np.float16),
             pattern((7,), np.float64, comm.rank, 2),
             make(comm.rank, 6, 9, ks, (), np.float64, np.int32),
             make(comm.rank, 7, 15, [2, 3, 1], (2,), bfloat16),
             make(comm.rank, 8, 20, [0, 2, 2], (3,), np.float32)]
    with Reducer(comm, sparse="gather") as reducer:
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
    with Reducer(comm, skip=[True, False]) as reducer:
        out = reducer.reduce(grads)
        assert reducer.plan(grads).sparse == ()
    assert out[0] is grads[0]
    assert_bitwise_equal(out[1], expected((3,), np.float32, comm.size, 1))


def test_out_takes_none_for_a_row_sparse_gradient(comm):
    """reduce(grads, out=...): a RowSparse gradient's entry is None (it comes back as a
    new RowSparse, its rows gathered); the dense ones are written into theirs."""
    sparse = make(comm.rank, 4, 20, (2, 3), (3,), np.float32)
    dense = pattern((5, 3), np.float32, comm.rank, 9)
    out = np.zeros((5, 3), np.float32)
    with Reducer(comm, sparse="gather") as reducer:
        got = reducer.reduce([dense, sparse], out=[out, None])
        with pytest.raises(TypeError, match=r"out\[1\]: expecting None for a RowSparse"):
            reducer.reduce([dense, sparse], out=[out, np.zeros((20, 3), np.float32)])
    assert got[0] is out
    assert_bitwise_equal(out, expected((5, 3), np.float32, comm.size, 9))
    indices, values = gather_reference(comm.size, 4, 20, (2, 3), (3,), np.float32, np.int64,
                                       True)
    assert isinstance(got[1], RowSparse)
    assert np.array_equal(got[1].indices, indices)
    assert_bitwise_equal(got[1].values, values)

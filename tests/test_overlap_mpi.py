"""start / ready / wait: buckets reduced while backward goes on. Run at 2 and 3 ranks."""

import numpy as np
import pytest

from helpers import assert_bitwise_equal, assert_same_on_all_ranks, expected, nodes, pattern
from mpigrad import Reducer, RowSparse

pytestmark = pytest.mark.mpi(min_size=2)

SHAPES = [(64, 8), (5,), (3, 3), (300,), (2,), (40, 10), (7,), ()]
DTYPES = [np.float32, np.float16, np.float64, np.float32, np.float16, np.float32,
          np.float64, np.float32]


def grads_for(comm):
    return [pattern(s, d, comm.rank, i) for i, (s, d) in enumerate(zip(SHAPES, DTYPES))]


def check(comm, out, mean=True):
    for i, (s, d) in enumerate(zip(SHAPES, DTYPES)):
        assert_bitwise_equal(out[i], expected(s, d, comm.size, i, mean=mean), f"grad {i}")
    assert_same_on_all_ranks(comm, out[:len(SHAPES)])


@pytest.mark.parametrize("order", ["backward", "random", "none"])
@pytest.mark.parametrize("bucket_bytes", [1, 256, None])
def test_ready_in_any_order_per_rank(comm, order, bucket_bytes):
    grads = grads_for(comm)
    with Reducer(comm, bucket_bytes=bucket_bytes, chunk_bytes=512) as reducer:
        handle = reducer.start(grads)
        indices = list(range(len(grads)))[::-1]
        if order == "random":            # a different arrival order on every rank
            np.random.default_rng(comm.rank).shuffle(indices)
        if order != "none":
            for index in indices:
                handle.ready(index)
        out = handle.wait()
    assert all(o is g for o, g in zip(out, grads))
    check(comm, out)


@pytest.mark.parametrize("wire", [None, "bfloat16"])
def test_across_nodes_each_bucket_is_summed_on_its_node_then_across(comm, wire):
    """Across nodes (with cross-memory sums) an overlapped call takes the hierarchy, as a
    blocking one does: each bucket's node sum as backward finishes it, its slice's way
    across the nodes behind the rest; the same additions, so the same bits."""
    with Reducer(comm, bucket_bytes=256, chunk_bytes=512, wire=wire) as reducer:
        handle = reducer.start(grads_for(comm))
        for index in reversed(range(len(SHAPES))):
            handle.ready(index)
        out = handle.wait()
        backend = reducer.backend
        blocking = reducer.reduce(grads_for(comm))
        across = reducer.uses_cross_memory and nodes(comm) > 1
    assert (backend == "cross-memory, overlapped") == across, backend
    if across:
        for got, want in zip(out, blocking):
            assert_bitwise_equal(got, want)
    if wire is None:
        check(comm, out)
    assert_same_on_all_ranks(comm, out)


def test_zero_copy_views_and_sparse(comm):
    like = grads_for(comm)
    sparse = RowSparse(np.array([comm.rank]), np.ones((1, 2), np.float32), (4, 2))
    with Reducer(comm, bucket_bytes=512, mean=False, sparse="gather") as reducer:
        views = reducer.bucket_views(like + [sparse])
        for v, g in zip(views, like):
            v[...] = g
        handle = reducer.start(views)
        for index in reversed(range(len(views))):
            handle.ready(index)
        out = handle.wait()
    check(comm, out, mean=False)
    assert out[-1].indices.tolist() == list(range(comm.size))


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_misuse_raises_with_and_without_verify(comm, verify):
    grads = grads_for(comm)
    with Reducer(comm, verify=verify) as reducer:
        handle = reducer.start(grads)
        handle.ready(0)
        with pytest.raises(ValueError, match="already marked ready"):
            handle.ready(0)
        with pytest.raises(ValueError, match=r"positions in \[0, 8\), got 99"):
            handle.ready(99)
        check(comm, handle.wait())
        with pytest.raises(RuntimeError, match="already finished"):
            handle.wait()
    check(comm, grads)          # reduced once: a second wait did not reduce again


def test_misuse(comm):
    grads = grads_for(comm)
    with Reducer(comm) as reducer:
        handle = reducer.start(grads)
        handle.ready(7)
        with pytest.raises(ValueError, match="already marked ready"):
            handle.ready(7)
        with pytest.raises(ValueError, match=r"positions in \[0, 8\), got 8"):
            handle.ready(8)
        handle.wait()
        with pytest.raises(RuntimeError, match="already finished"):
            handle.wait()
        grads[0].flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            reducer.start(grads)

"""The speed features of docs/performance.md, checked by what reaches MPI: which memory each
collective reduces in, when the overlap path starts its collectives, and how
many collectives sparse gradients cost (these with MPI's Allreduce:
shared_memory=False); and that node-shared buckets send no gradient data
through the Reducer's communicator. The communicator is wrapped so that
every collective mpigrad issues is logged. Run under mpiexec -n 2 and -n 3."""

import numpy as np
import pytest

from helpers import assert_bitwise_equal, expected, pattern, recording
from mpigrad import Reducer, RowSparse

pytestmark = pytest.mark.mpi(min_size=2)


def data_buffers(log):
    """The arrays of the Allreduce calls that carried gradient data (int64
    flags left out)."""
    return [a for name, a in log if name == "Allreduce" and a.dtype != np.int64]


def without_agreements(log, size):
    """The log's names but the agreements' (an Allgather of every rank's slot)."""
    from mpigrad._comm.checked import inline_capacity
    slots = (size, 5 + inline_capacity(size) // 8)
    return [name for name, a in log if not (name == "Allgather" and a.shape == slots)]


def test_big_gradients_are_reduced_in_their_own_memory(comm):
    wrapped, log = recording(comm)
    grads = [pattern((64, 32), np.float32, comm.rank, i) for i in range(2)] + \
        [pattern((8,), np.float32, comm.rank, 2), pattern((9,), np.float32, comm.rank, 3)]
    with Reducer(wrapped, bucket_bytes=1024, chunk_bytes=1000, shared_memory=False) as reducer:
        del log[:]
        reducer.reduce(grads, inplace=True)
    buffers = data_buffers(log)
    for big in grads[:2]:               # every piece of a big one lies in its memory
        pieces = [b for b in buffers if np.shares_memory(b, big)]
        assert sum(p.size for p in pieces) == big.size
    small = [b for b in buffers if not any(np.shares_memory(b, g) for g in grads)]
    assert sum(b.size for b in small) == 17          # the small ones: packed together
    for i, g in enumerate(grads):
        assert_bitwise_equal(g, expected(g.shape, np.float32, comm.size, i))


@pytest.mark.parametrize("chunk_bytes, messages", [(None, 1), (320, 3)])
def test_zero_copy_reduces_the_bucket_views_memory(comm, chunk_bytes, messages):
    wrapped, log = recording(comm)
    like = [pattern((40,), np.float32, comm.rank, i) for i in range(5)]
    with Reducer(wrapped, bucket_bytes=320, chunk_bytes=chunk_bytes,
                 shared_memory=False) as reducer:
        views = reducer.bucket_views(like)
        for v, g in zip(views, like):
            v[...] = g
        del log[:]
        reducer.reduce(views, inplace=True)
    buffers = data_buffers(log)
    # 3 buckets (2 + 2 + 1 gradients) side by side: one run, cut into chunks
    assert len(buffers) == messages
    for b in buffers:                     # each message is the memory of views
        assert any(np.shares_memory(b, v) for v in views)
    for v in views:
        assert any(np.shares_memory(b, v) for b in buffers)
    for i, v in enumerate(views):
        assert_bitwise_equal(v, expected((40,), np.float32, comm.size, i))


def test_overlap_starts_a_bucket_before_wait(comm):
    wrapped, log = recording(comm)
    grads = [pattern((100,), np.float32, comm.rank, i) for i in range(4)]
    with Reducer(wrapped, bucket_bytes=400, shared_memory=False) as reducer:   # a bucket each
        del log[:]
        handle = reducer.start(grads)
        checks = len(log)
        handle.ready(3)                   # the last bucket is complete: it goes now
        assert len(data_buffers(log[checks:])) == 1
        assert np.shares_memory(data_buffers(log)[0], grads[3])
        handle.ready(2, 1, 0)
        handle.wait()
    assert len(data_buffers(log)) == 4
    for i, g in enumerate(grads):
        assert_bitwise_equal(g, expected((100,), np.float32, comm.size, i))


def test_sparse_costs_one_count_exchange_and_two_gathers_per_wire_dtype(comm):
    wrapped, log = recording(comm)
    grads = [RowSparse(np.array([comm.rank % 4]), pattern((1, 3), dt, comm.rank, i), (4, 3))
             for i, dt in enumerate([np.float32, np.float64, np.float16, np.float64])]
    with Reducer(wrapped, sparse="gather") as reducer:
        del log[:]
        out = reducer.reduce(grads)
    names = without_agreements(log, comm.size)
    assert names.count("Allgather") == 1
    assert names.count("Allgatherv") == 4            # float32 and float64: indices, values
    assert [o.nnz for o in out] == [comm.size] * 4


def test_node_shared_buckets_send_no_gradient_data_through_mpi(comm, monkeypatch):
    monkeypatch.delenv("MPIGRAD_NODE_SIZE", raising=False)      # one node: this machine
    wrapped, log = recording(comm)
    grads = [pattern((1000,), np.float32, comm.rank, i) for i in range(3)]
    with Reducer(wrapped, shared_memory=True) as reducer:
        views = reducer.bucket_views(grads)
        for v, g in zip(views, grads):
            v[...] = g
        del log[:]
        reducer.reduce(views, inplace=True)
        grads[0] = grads[0] * 2
        out = reducer.reduce(grads)       # True: packs into the views' memory
    assert data_buffers(log) == []
    for i, (v, o) in enumerate(zip(views, out)):
        want = expected((1000,), np.float32, comm.size, i) * (2 if i == 0 else 1)
        assert_bitwise_equal(o, want)
        assert_bitwise_equal(v, want)     # the views hold that call's results

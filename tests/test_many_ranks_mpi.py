"""The core at any rank count: reduce, start/wait, reduce-scatter and the wire, each
against the reference computed from the rank count and with the same bits on every rank.
Run at 2 and 3 ranks with the suite, and by the test command at 16 ranks: 4 nodes x 4 and
nodes of 3 + 5 + 4 + 4 ranks on a cluster of namespaces (MPIGRAD_NODE_SIZE=4 without
one)."""

import numpy as np
import pytest

from helpers import assert_bitwise_equal, assert_same_on_all_ranks, expected, pattern
from mpigrad import Reducer

pytestmark = pytest.mark.mpi(min_size=2)

#: a model's mix: matrices, vectors, a scalar, sizes that no rank count divides
SHAPES = [(64, 33), (33,), (), (1000,), (7, 7), (257,)]
DTYPES = [np.float32, np.float16, np.float64]
#: how the sums may go: the Reducer's choice (node sums where nodes are equal), MPI only
PATHS = {"auto": {}, "mpi": {"shared_memory": False, "cross_memory": False}}


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def grads_of(comm):
    return [pattern(s, DTYPES[i % 3], comm.rank, i) for i, s in enumerate(SHAPES)]


def check(comm, out, mean=True):
    for i, (got, shape) in enumerate(zip(out, SHAPES)):
        assert_bitwise_equal(got, expected(shape, DTYPES[i % 3], comm.size, i, mean=mean),
                             f"gradient {i}")
    assert_same_on_all_ranks(comm, out)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("inplace", [False, True])
def test_reduce(comm, path, inplace):
    with Reducer(comm, bucket_bytes=4096, **PATHS[path]) as reducer:
        for _ in range(2):                      # the second call on the cached plan
            grads = grads_of(comm)
            out = reducer.reduce(grads, inplace=inplace)
            check(comm, grads if inplace else out)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_start_and_wait_with_gradients_ready_last_first(comm, path):
    with Reducer(comm, bucket_bytes=4096, mean=False, **PATHS[path]) as reducer:
        grads = grads_of(comm)
        pending = reducer.start(grads)
        for i in reversed(range(len(grads))):
            pending.ready(i)
        check(comm, pending.wait(), mean=False)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_reduce_scatter_then_allgather(comm, path):
    with Reducer(comm, bucket_bytes=4096, **PATHS[path]) as reducer:
        grads = grads_of(comm)
        shards = reducer.reduce_scatter(grads)
        for wire, ranges in reducer.shards(grads).items():
            want = [expected(SHAPES[i], DTYPES[i % 3], comm.size, i).astype(wire).ravel()[a:b]
                    for i, a, b in ranges]
            got, want = shards[wire], np.concatenate(want) if want else np.empty(0, wire)
            assert np.allclose(got, want, rtol=1e-3, atol=1e-3)     # half: the float32 mean
        into = [np.zeros(s, DTYPES[i % 3]) for i, s in enumerate(SHAPES)]
        check(comm, reducer.allgather_shards(shards, into))


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_the_wire_carries_small_integers_exactly(comm, wire):
    """Through MPI (and across nodes) float32 buckets travel the wire: the patterns'
    sums (integers below 2^8) are exact there, so the bits are the float32 reference's."""
    with Reducer(comm, bucket_bytes=4096, wire=wire, mean=False, **PATHS["mpi"]) as reducer:
        grads = [pattern(s, np.float32, comm.rank, i) for i, s in enumerate(SHAPES)]
        out = reducer.reduce(grads)
        for i, (got, shape) in enumerate(zip(out, SHAPES)):
            assert_bitwise_equal(got, expected(shape, np.float32, comm.size, i, mean=False))
        assert_same_on_all_ranks(comm, out)

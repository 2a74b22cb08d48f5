"""Results on data whose float sums depend on the order of the additions:
against an independent float64 numpy reference within a tolerance derived from
the dtype and the rank count (bitwise where at most 2 ranks leave MPI no choice
of order), and bitwise identical on every rank, on every dense path, summed by
MPI's Allreduce and in node-shared memory. Run under mpiexec -n 2 and -n 3, on
COMM_WORLD, a split communicator and one of size 1 (and at 4 ranks as 2 nodes
of 2 with MPIGRAD_NODE_SIZE=2)."""

import numpy as np
import pytest

from helpers import (ALL_DTYPES, assert_bitwise_equal, assert_same_on_all_ranks, assert_within,
                     exact_when_order_is_fixed, noisy, reference)
from mpigrad import Reducer

pytestmark = pytest.mark.mpi(min_size=2)

SHAPES = [(64, 40), (7,), (), (33, 5), (0,), (300,), (2, 3)]
PATHS = ["copy", "inplace", "zero-copy", "overlap", "verify", "small chunks", "split"]
OPTIONS = {"copy": {}, "inplace": {}, "zero-copy": {}, "overlap": {}, "verify": {"verify": True},
           "small chunks": {"chunk_bytes": 40}, "split": {"split_indices": [1, 4]}}


def inputs_of(comm, shape, dtype, seed):
    return [noisy(shape, dtype, r, seed) for r in range(comm.size)]


def run(comm, reducer, path, grads):
    if path == "copy" or path == "split":
        return reducer.reduce(grads)
    if path == "zero-copy":
        views = reducer.bucket_views(grads)
        for view, grad in zip(views, grads):
            if view is not grad:
                view[...] = grad
        return reducer.reduce(views, inplace=True)
    if path == "overlap":               # every rank marks its gradients in its own order
        handle = reducer.start(grads)
        order = np.random.default_rng(comm.rank).permutation(len(grads))
        for index in order[:len(order) // 2]:
            handle.ready(int(index))
        return handle.wait()
    return reducer.reduce(grads, inplace=True)


# verify reduces through MPI: shared_memory=True refuses it
@pytest.mark.parametrize("path, shared", [(p, s) for s in (False, True) for p in PATHS
                                          if not (s and p == "verify")],
                         ids=lambda v: {False: "mpi", True: "node memory"}.get(v, v))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
def test_order_sensitive_sums(comm, path, dtype, mean, shared):
    grads = [noisy(s, dtype, comm.rank, i) for i, s in enumerate(SHAPES)]
    with Reducer(comm, mean=mean, bucket_bytes=1024, shared_memory=shared,
                 **OPTIONS[path]) as reducer:
        assert reducer.uses_shared_memory == shared
        out = run(comm, reducer, path, grads)
    for i, shape in enumerate(SHAPES):
        inputs = inputs_of(comm, shape, dtype, i)
        assert out[i].dtype == dtype and out[i].shape == shape
        want, tol = reference(inputs, dtype, mean)
        assert_within(out[i], want, tol, f"grad {i} {dtype.name}{shape}")
        exact = exact_when_order_is_fixed(inputs, dtype, mean)
        if exact is not None:
            assert_bitwise_equal(out[i], exact, f"grad {i} {dtype.name}{shape}")
    assert_same_on_all_ranks(comm, out)


def test_tolerance_is_tight_enough_to_see_a_missing_rank(comm):
    """The derived tolerance rejects a result that lacks one rank's share."""
    if comm.size == 1:
        pytest.skip("a communicator of size 1 has no other rank to miss")
    inputs = inputs_of(comm, (200,), np.float32, 0)
    want, tol = reference(inputs, np.float32, mean=False)
    wrong = sum(x.astype(np.float64) for x in inputs[:-1]).astype(np.float32)
    with pytest.raises(AssertionError, match="beyond the derived tolerance"):
        assert_within(wrong, want, tol)

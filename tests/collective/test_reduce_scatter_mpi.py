"""_collective/reduce_scatter.py: REDUCE_SCATTER through the layer: every
rank's sends taken end to end, reduced, rank r keeping the r-th share (equal
parts, or the counts given: uneven, empty), the mean and the ops."""

import gc
import weakref

import numpy as np
import pytest

from mpigrad._collective import Kind

from .specs import reduced, spec

pytestmark = pytest.mark.mpi(min_size=2)


def addends(rank, sizes):
    """Rank ``rank``'s sends: arrays of ``sizes`` elements."""
    return [np.arange(n, dtype=np.float64) * (rank + 1) + rank for n in sizes]


def whole(op, sizes, size):
    """``op`` over every rank's sends, end to end."""
    return reduced(op, np.stack([np.concatenate(addends(r, sizes)) for r in range(size)]))


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("sizes", [[6], [4, 0, 9], [50_000, 3]])
def test_equal_shares_of_the_sends_end_to_end(group, op, sizes):
    n = sum(sizes) // group.size * group.size
    sizes = sizes[:-1] + [sizes[-1] - (sum(sizes) - n)]     # a multiple of the ranks
    share = n // group.size
    out = np.empty(share)
    group.run(spec(Kind.REDUCE_SCATTER, "reduce_scatter", addends(group.rank, sizes), [out],
                   op=op))
    want = whole(op, sizes, group.size)[group.rank * share:(group.rank + 1) * share]
    np.testing.assert_allclose(out, want, rtol=1e-12)


def test_uneven_counts_and_an_empty_share(group):
    counts = tuple([3] * (group.size - 1) + [0]) if group.size > 1 else (3,)
    out = np.empty(counts[group.rank])
    group.run(spec(Kind.REDUCE_SCATTER, "reduce_scatter", addends(group.rank, [sum(counts)]),
                   [out], counts=counts))
    start = sum(counts[:group.rank])
    want = whole("sum", [sum(counts)], group.size)[start:start + counts[group.rank]]
    assert np.array_equal(out, want)


def test_what_mpi_reads_lives_until_the_operation_completes(group):
    """A started operation holds the buffers it was started with (mpi4py's request
    does not): a packed copy its maker drops stays alive while MPI reads it (under
    Open MPI a reduce-scatter of two arrays by max read its freed copy: garbage in
    its first elements, or a segmentation fault)."""
    counts = [4] * group.size
    send = np.arange(4.0 * group.size) + group.rank
    held = weakref.ref(send)
    out = np.empty(4)
    with group.calls():
        started = group.communicator.start_reduce_scatter(send, out, counts, "a test", "max")
        del send
        gc.collect()
        assert held() is not None
        group.communicator.wait(started)
    start = 4 * group.rank
    assert np.array_equal(out, np.arange(start, start + 4.0) + group.size - 1)

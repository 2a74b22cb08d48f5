"""_collective/alltoall.py: ALLTOALL through the layer (each rank's part for
every rank, of sizes that differ by pair and may be empty; sizes that do not
pair up raise on every rank before anything moves) and SCATTER from each root."""

import numpy as np
import pytest

from mpigrad import StructureMismatchError
from mpigrad._collective import Kind

from .specs import spec

pytestmark = pytest.mark.mpi(min_size=2)


def sent(sender, receiver):
    """What ``sender`` sends ``receiver``: (sender + receiver) % 3 values."""
    return np.full((sender + receiver) % 3, 100 * sender + receiver, np.int64)


def test_parts_of_every_size_reach_their_rank(group):
    size, rank = group.size, group.rank
    outs = [np.empty_like(sent(r, rank)) for r in range(size)]
    group.run(spec(Kind.ALLTOALL, "alltoall", [sent(rank, r) for r in range(size)], outs,
                   shapes=False))
    for r in range(size):
        assert np.array_equal(outs[r], sent(r, rank))


def test_sizes_that_do_not_pair_up_raise_on_every_rank(group):
    if group.size == 1:
        pytest.skip("one rank always pairs with itself")
    size, rank = group.size, group.rank
    outs = [np.full(2 if (rank, r) == (1, 0) else 1, -1.0) for r in range(size)]
    with pytest.raises(StructureMismatchError, match="rank 0 sending 8 bytes to rank 1"):
        group.run(spec(Kind.ALLTOALL, "alltoall", [np.ones(1) for _ in range(size)], outs,
                       shapes=False))
    assert all((o == -1).all() for o in outs)


def test_scatter_from_every_root(group):
    for root in range(group.size):
        parts = [np.full(3, 10 * root + r, np.float64) for r in range(group.size)]
        out = np.empty(3)
        group.run(spec(Kind.SCATTER, "scatter", parts if group.rank == root else [], [out],
                       items=("float64[3]",), root=root))
        assert (out == 10 * root + group.rank).all()

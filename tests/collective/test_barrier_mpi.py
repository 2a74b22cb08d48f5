"""_collective/barrier.py: BARRIER through the layer: it returns on every rank
once all have come, after their earlier calls; against another kind on one
rank it raises on every rank, naming both."""

import numpy as np
import pytest

from mpigrad import StructureMismatchError
from mpigrad._collective import Kind

from .specs import spec

pytestmark = pytest.mark.mpi(min_size=2)


def test_a_barrier_returns_on_every_rank(group):
    for _ in range(3):
        assert group.run(spec(Kind.BARRIER, "barrier")) is None


def test_a_barrier_against_an_allreduce_raises_on_every_rank(group):
    if group.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    value = np.ones(3)
    call = spec(Kind.BARRIER, "barrier") if group.rank == 0 else \
        spec(Kind.ALLREDUCE, "allreduce", [value])
    with pytest.raises(StructureMismatchError, match="barrier on rank 0 and allreduce"):
        group.run(call)
    assert (value == 1).all()
    group.run(spec(Kind.BARRIER, "barrier"))            # the group goes on

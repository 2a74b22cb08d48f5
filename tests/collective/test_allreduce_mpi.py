"""_collective/allreduce.py: ALLREDUCE and REDUCE through the layer (below the
engine's sizes: carried on the agreement where small, else through MPI),
every op of the table against its reference, the mean, Horovod's scales, the
results in place, apart or fresh."""

import numpy as np
import pytest

from mpigrad._collective import Kind
from mpigrad._collective.ops import OPS

from .specs import reduced, spec

pytestmark = pytest.mark.mpi(min_size=2)

#: a small call (carried on the agreement) and one that moves after it
ELEMENTS = [7, 20_000]


def values(rank, n, dtype):
    """Rank ``rank``'s addend: small integers (every op's result exact)."""
    return ((np.arange(n) * 3 + 5 * rank + 1) % 7 + 1).astype(dtype)


def reference(op, n, dtype, size):
    """``op`` over every rank's addend, in float64 (exact here)."""
    return reduced(op, np.stack([values(r, n, np.float64) for r in range(size)]))


#: every op of the table on floats, and on integers but the mean (a face's rule there:
#: refused, truncated or widened)
CASES = [(op, dtype) for op in ("sum", "mean", "max", "min", "prod")
         for dtype in (np.float32, np.float64, np.int32) if op != "mean" or dtype != np.int32]


@pytest.mark.parametrize("elements", ELEMENTS)
@pytest.mark.parametrize("op, dtype", CASES)
def test_every_op_in_place_equals_its_reference(group, op, dtype, elements):
    assert op in OPS
    mine = values(group.rank, elements, dtype)
    group.run(spec(Kind.ALLREDUCE, "allreduce", [mine], op=op))
    want = reference(op, elements, dtype, group.size)
    np.testing.assert_allclose(mine, want.astype(dtype), rtol=1e-6)


@pytest.mark.parametrize("elements", ELEMENTS)
def test_results_apart_and_fresh_leave_the_inputs(group, elements):
    mine = values(group.rank, elements, np.float64)
    kept = mine.copy()
    out = np.empty_like(mine)
    group.run(spec(Kind.ALLREDUCE, "allreduce", [mine], [out]))
    fresh = group.run(spec(Kind.ALLREDUCE, "allreduce", [mine], fresh=True))
    want = reference("sum", elements, np.float64, group.size)
    assert np.array_equal(mine, kept)
    assert np.array_equal(out, want) and np.array_equal(fresh[0], want)


def test_scales_as_horovod_applies_them(group):
    """Each addend times the prescale, the result times the postscale (after the mean)."""
    mine = values(group.rank, 5, np.float64)
    group.run(spec(Kind.ALLREDUCE, "allreduce", [mine], op="mean", prescale=2.0,
                   postscale=0.5))
    np.testing.assert_allclose(mine, reference("mean", 5, np.float64, group.size))


@pytest.mark.parametrize("elements", ELEMENTS)
def test_reduce_writes_on_the_root_only(group, elements):
    root = group.size - 1
    mine = values(group.rank, elements, np.float64)
    out = np.full(elements, -1.0)
    group.run(spec(Kind.REDUCE, "reduce", [mine], [out], op="max", root=root))
    want = reference("max", elements, np.float64, group.size)
    assert np.array_equal(out, want) if group.rank == root else (out == -1.0).all()

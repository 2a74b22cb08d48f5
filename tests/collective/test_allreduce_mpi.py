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


#: a direct call's cases: one array that is its own message (the mean and a postscale
#: scale it), as op x dtype x postscale
DIRECT = [("sum", np.float32, 1.0), ("mean", np.float32, 1.0), ("mean", np.float64, 0.25),
          ("sum", np.complex64, 3.0), ("mean", np.complex128, 1.0), ("prod", np.float64, 1.0),
          ("max", np.float32, 1.0), ("sum", np.int32, 1.0), ("min", np.int64, 1.0)]


def addend(rank, dtype):
    """Rank ``rank``'s random addend of ``dtype``, nan and infinities among its values
    (floating point)."""
    rng = np.random.default_rng(rank)
    complex_ = np.dtype(dtype).kind == "c"
    raw = rng.standard_normal(66 if complex_ else 33) * 1e3
    if np.dtype(dtype).kind in "fc":
        raw[[3, 9, 17]] = [np.nan, np.inf, -np.inf] if rank == 0 else [1.5, 2.5, -np.inf]
    return (raw.view(np.complex128) if complex_ else raw).astype(dtype)


_LOCAL = {"sum": np.add, "mean": np.add, "prod": np.multiply, "max": np.maximum,
          "min": np.minimum}


@pytest.mark.parametrize("op, dtype, postscale", DIRECT)
def test_one_small_array_has_the_bits_of_the_packed_path(group, op, dtype, postscale):
    """A small call of one array, reduced back into itself (the carriage's direct
    run, kept or not), gives the bits of the same array among others (packed,
    then settled), and of every rank's addend reduced in rank order then scaled
    by the engine's one mean (and the postscale) in the real dtype."""
    from mpigrad._collective import Kept
    mine = addend(group.rank, dtype)
    other = np.arange(5, dtype=np.int16) + group.rank
    fields = dict(op=op, postscale=postscale)
    direct, kept, packed = mine.copy(), mine.copy(), mine.copy()
    group.run(spec(Kind.ALLREDUCE, "allreduce", [direct], **fields))
    template = spec(Kind.ALLREDUCE, "allreduce", [kept], **fields).replaced(sends=())
    for _ in range(2):                     # (its plan made, then kept)
        kept[...] = mine
        group.run(Kept(template, (kept,)))
    group.run(spec(Kind.ALLREDUCE, "allreduce", [packed, other], **fields))
    want = addend(0, dtype)
    with np.errstate(all="ignore"):
        for r in range(1, group.size):
            _LOCAL[op](want, addend(r, dtype), out=want)
        real = want.view(np.finfo(dtype).dtype) if np.dtype(dtype).kind == "c" else want
        if op == "mean":
            real *= np.finfo(dtype).dtype.type(1.0 / group.size)
        if postscale != 1.0:
            real *= np.finfo(dtype).dtype.type(postscale)
    assert direct.tobytes() == packed.tobytes() == kept.tobytes() == want.tobytes()


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_a_small_reduce_of_one_array_reaches_the_root_only(group, op):
    root = group.size - 1
    mine = values(group.rank, 9, np.float32)
    kept = mine.copy()
    group.run(spec(Kind.REDUCE, "reduce", [mine], op=op, root=root))
    want = reference(op, 9, np.float32, group.size).astype(np.float32)
    if group.rank == root:
        np.testing.assert_allclose(mine, want, rtol=1e-6)
    else:
        assert np.array_equal(mine, kept)

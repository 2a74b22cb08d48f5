"""Property tests: random gradient lists, plans and settings, the same draw on
every rank (rank 0's draw is broadcast), against the numpy reference and for
bitwise equality across ranks. Run under mpiexec -n 2 and -n 3."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import ALL_DTYPES, expected, pattern, sparse_rows
from mpigrad import Reducer, RowSparse
from mpigrad._base.dtypes import bfloat16, wire_dtype

pytestmark = pytest.mark.mpi(min_size=2)

REAL = [np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64)]


@st.composite
def cases(draw):
    n = draw(st.integers(0, 10))
    grads = []
    for _ in range(n):
        if draw(st.booleans()) and draw(st.booleans()):
            grads.append(("sparse", draw(st.integers(1, 8)),
                          draw(st.tuples() | st.tuples(st.integers(1, 3))),
                          draw(st.sampled_from(REAL)),
                          draw(st.lists(st.integers(0, 6), min_size=3, max_size=3))))
        else:
            grads.append(("dense", draw(st.lists(st.integers(0, 4), max_size=3).map(tuple)),
                          draw(st.sampled_from(ALL_DTYPES))))
    split = draw(st.none() | st.sets(st.integers(1, max(1, n - 1)), max_size=3).map(
        lambda s: sorted(x for x in s if x < n) or None))
    return {"grads": grads, "skip": draw(st.none() | st.lists(st.booleans(), min_size=n,
                                                                max_size=n)),
            "split_indices": split, "bucket_bytes": draw(st.none() | st.integers(1, 200)),
            "mean": draw(st.booleans()), "sparse": draw(st.sampled_from(["auto", "gather",
                                                                          "dense"]))}


def build(case, rank):
    grads = []
    for i, g in enumerate(case["grads"]):
        if g[0] == "dense":
            grads.append(pattern(g[1], g[2], rank, i))
        else:
            _, rows, width, dtype, ks = g
            idx, val = sparse_rows(rank, i, rows, ks[rank % 3], width, dtype)
            grads.append(RowSparse(idx, val, (rows, *width)))
    return grads


def sparse_references(g, i, size, mean):
    """Both exact results a RowSparse gradient may reduce to (the values are
    small integers, so every sum is exact): gathered (every rank's rows in
    rank order, each scaled and rounded) and densified (the touched rows of
    the sum, scaled and rounded once), as (indices, values) pairs."""
    _, rows, width, dtype, ks = g
    wire = wire_dtype(dtype)
    parts = [sparse_rows(r, i, rows, ks[r % 3], width, dtype) for r in range(size)]
    scale = wire.type(1.0 / size) if mean and size > 1 else None
    values = np.concatenate([v.astype(wire) for _, v in parts]).reshape(-1, *width)
    if scale is not None:
        values = values * scale
    gathered = (np.concatenate([ix for ix, _ in parts]), values.astype(dtype))
    total = np.zeros((rows, *width), wire)
    for ix, v in parts:
        np.add.at(total, ix, v.astype(wire))
    if scale is not None:
        total = total * scale
    touched = np.unique(gathered[0])
    return {"gather": gathered, "dense": (touched, total[touched].astype(dtype))}


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def problems(comm, case, out, grads):
    """What is wrong with this rank's results, judged locally."""
    found = []
    skip = case["skip"] or [False] * len(grads)
    for i, (g, o) in enumerate(zip(case["grads"], out)):
        if skip[i]:
            if o is not grads[i]:
                found.append(f"{i}: skipped gradient not returned as given")
        elif g[0] == "dense":
            if not same_bits(o, expected(g[1], g[2], comm.size, i, mean=case["mean"])):
                found.append(f"{i}: dense {g[2]}{g[1]} differs from the reference")
        else:
            refs = sparse_references(g, i, comm.size, case["mean"])
            allowed = list(refs) if case["sparse"] == "auto" else [case["sparse"]]
            if not any(same_bits(o.indices, refs[m][0]) and same_bits(o.values, refs[m][1])
                       for m in allowed):
                found.append(f"{i}: sparse {g[3]} differs from the {'/'.join(allowed)} "
                             "reference")
    return found


def blobs_of(case, out):
    skip = case["skip"] or [False] * len(out)
    return [b for i, o in enumerate(out) if not skip[i] for b in (
        (o.indices.tobytes(), o.values.tobytes()) if isinstance(o, RowSparse)
        else (np.ascontiguousarray(o).tobytes(),))]


@settings(max_examples=100, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_random_lists_match_reference_on_every_rank(case):
    """Every rank passes or fails each example together (one allgather of
    the verdicts, whatever raised), so hypothesis shrinks in step on all
    ranks and a failure on one rank cannot leave the others waiting."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    case = comm.bcast(case)                  # the same draw on every rank
    found, blobs = [], None
    try:
        grads = build(case, comm.rank)
        kwargs = {k: case[k] for k in ("skip", "split_indices", "bucket_bytes", "mean",
                                       "sparse")}
        with Reducer(**kwargs) as reducer:
            out = reducer.reduce(grads)
        found, blobs = problems(comm, case, out, grads), blobs_of(case, out)
    except Exception as exc:                 # noqa: BLE001  (reported on every rank)
        found = [f"raised {type(exc).__name__}: {exc}"]
    verdicts = comm.allgather((found, blobs))     # the same verdict on every rank
    failed = [(r, f) for r, (f, _) in enumerate(verdicts) if f]
    first = verdicts[0][1]
    differ = [r for r, (_, b) in enumerate(verdicts)
              if b is not None and first is not None and b != first]
    assert not failed and not differ, (failed, f"results differ from rank 0's on {differ}")

"""Property tests: random gradient lists, plans and settings, the same draw on
every rank (rank 0's draw is broadcast), against the numpy reference and for
bitwise equality across ranks. Run under mpiexec -n 2 and -n 3."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import ALL_DTYPES, expected, pattern, sparse_rows
from mpigrad import Reducer, RowSparse
from mpigrad.dtypes import bfloat16

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


def sparse_reference(g, i, size, mean):
    _, rows, width, dtype, ks = g
    total = sum(build_one(g, i, r).to_dense().astype(np.float64) for r in range(size))
    return total / size if mean else total


def build_one(g, i, rank):
    _, rows, width, dtype, ks = g
    return RowSparse(*sparse_rows(rank, i, rows, ks[rank % 3], width, dtype), (rows, *width))


def problems(comm, case, out, grads):
    found = []
    skip = case["skip"] or [False] * len(grads)
    for i, (g, o) in enumerate(zip(case["grads"], out)):
        if skip[i]:
            if o is not grads[i]:
                found.append(f"{i}: skipped gradient not returned as given")
        elif g[0] == "dense":
            want = expected(g[1], g[2], comm.size, i, mean=case["mean"])
            if o.dtype != want.dtype or o.shape != want.shape or \
                    o.tobytes() != np.ascontiguousarray(want).tobytes():
                found.append(f"{i}: dense {g[2]}{g[1]} differs from the reference")
        else:
            want = sparse_reference(g, i, comm.size, case["mean"])
            got = o.to_dense().astype(np.float64)
            tol = 0 if not case["mean"] else (2e-2 if g[3].itemsize == 2 else 1e-6)
            if not np.allclose(got, want, rtol=tol, atol=tol):
                found.append(f"{i}: sparse {g[3]} to_dense differs from the reference")
    blobs = [b for i, o in enumerate(out) if not skip[i] for b in (
        (o.indices.tobytes(), o.values.tobytes()) if isinstance(o, RowSparse)
        else (np.ascontiguousarray(o).tobytes(),))]
    if blobs != comm.bcast(blobs):
        found.append("results differ from rank 0's")
    return found


@settings(max_examples=100, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_random_lists_match_reference_on_every_rank(case):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    case = comm.bcast(case)                  # the same draw on every rank
    grads = build(case, comm.rank)
    kwargs = {k: case[k] for k in ("skip", "split_indices", "bucket_bytes", "mean", "sparse")}
    with Reducer(**kwargs) as reducer:
        out = reducer.reduce(grads)
    found = comm.allgather(problems(comm, case, out, grads))
    assert not any(found), found             # every rank fails together: no hang

"""_collective/allgather.py: ALLGATHER and GATHER through the layer: every
rank's array in rank order (into one output, in place where the input is this
rank's part of it, or into one output per rank), every rank's payload (any
sizes), every rank's rows (row counts that differ, none; the mean of the
floating-point ones), and GATHER onto the root only."""

import numpy as np
import pytest

from mpigrad._collective import Kind

from .specs import spec

pytestmark = pytest.mark.mpi(min_size=2)


def part(rank, n=4):
    return np.arange(n, dtype=np.float32) + 10 * rank


def every(size, n=4):
    return np.concatenate([part(r, n) for r in range(size)])


@pytest.mark.parametrize("n", [4, 30_000])
def test_into_one_output_a_list_and_in_place(group, n):
    size, rank = group.size, group.rank
    whole = np.empty(size * n, np.float32)
    group.run(spec(Kind.ALLGATHER, "allgather", [part(rank, n)], [whole]))
    assert np.array_equal(whole, every(size, n))
    outs = [np.empty(n, np.float32) for _ in range(size)]
    group.run(spec(Kind.ALLGATHER, "allgather", [part(rank, n)], outs))
    assert np.array_equal(np.concatenate(outs), every(size, n))
    whole = np.zeros(size * n, np.float32)
    mine = whole[rank * n:(rank + 1) * n]
    mine[...] = part(rank, n)
    group.run(spec(Kind.ALLGATHER, "allgather", [mine], [whole]))
    assert np.array_equal(whole, every(size, n))


def test_payloads_of_any_size_in_rank_order(group):
    got = group.run(spec(Kind.ALLGATHER, "allgather", payload=b"x" * (3 * group.rank)))
    assert got == [b"x" * (3 * r) for r in range(group.size)]


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_rows_of_every_rank_whatever_their_counts(group, op):
    rows = group.rank % 3                # rank 0 has none
    values = np.full((rows, 2), float(group.rank + 1))
    indices = np.full(rows, group.rank, np.int64)
    (got_indices, got_values), counts = group.run(
        spec(Kind.ALLGATHER, "rows", [indices, values], shapes=False,
             op=op))
    assert counts == [r % 3 for r in range(group.size)]
    assert got_indices.tolist() == [r for r in range(group.size) for _ in range(r % 3)]
    scale = 1.0 / group.size if op == "mean" else 1.0
    want = [[(r + 1) * scale] * 2 for r in range(group.size) for _ in range(r % 3)]
    np.testing.assert_allclose(got_values.reshape(-1, 2), np.array(want).reshape(-1, 2))


def test_gather_onto_the_root_only(group):
    root = group.size - 1
    out = np.full(group.size * 4, -1.0, np.float32)
    group.run(spec(Kind.GATHER, "gather", [part(group.rank)], [out], root=root))
    assert np.array_equal(out, every(group.size)) if group.rank == root else (out == -1).all()

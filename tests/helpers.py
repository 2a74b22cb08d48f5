"""Shared helpers: rank-dependent gradients and their numpy reference."""

import math
import os
import shutil
import sys

import numpy as np

from mpigrad.dtypes import bfloat16, wire_dtype

ALL_DTYPES = [np.dtype(np.float16), bfloat16, np.dtype(np.float32),
              np.dtype(np.float64), np.dtype(np.complex64), np.dtype(np.complex128)]


def pattern(shape, dtype, rank, seed=0):
    """Small integers depending on rank and seed: exact in every dtype, and so
    are their sums over a few ranks, whatever order MPI adds them in."""
    size = math.prod(shape)
    base = (np.arange(size, dtype=np.int64) * (seed + 1) + 3 * rank + seed) % 11 - 5
    values = base.astype(np.float64)
    if np.dtype(dtype).kind == "c":
        values = values + 1j * ((base * 7 + rank) % 5 - 2)
    return values.reshape(shape).astype(dtype)


def expected(shape, dtype, size, seed=0, mean=True, degree=None):
    """The numpy reference of reducing pattern(shape, dtype, r, seed) over ``size`` ranks."""
    wire = wire_dtype(dtype)
    total = sum(pattern(shape, dtype, r, seed).astype(wire) for r in range(size))
    total = np.asarray(total, dtype=wire).reshape(shape)
    degree = size if degree is None else degree
    if mean and degree != 1:
        total = total * wire.type(1.0 / degree)
    return np.asarray(total).astype(dtype)


def assert_bitwise_equal(got, want, label=""):
    assert got.dtype == want.dtype, f"{label}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    g = np.ascontiguousarray(got).view(np.uint8)
    w = np.ascontiguousarray(want).view(np.uint8)
    assert np.array_equal(g, w), f"{label}: values differ\n got {got!r}\nwant {want!r}"


def assert_same_on_all_ranks(comm, arrays):
    """Every rank holds bitwise the same arrays as rank 0."""
    blobs = [np.ascontiguousarray(a).tobytes() for a in arrays]
    root = comm.bcast(blobs, root=0)
    diff = [i for i, (a, b) in enumerate(zip(blobs, root)) if a != b]
    all_diff = comm.allgather(diff)
    assert not any(all_diff), f"results differ from rank 0 at positions {all_diff}"


def sparse_rows(rank, seed, rows, k, width_shape, dtype, index_dtype=np.int64):
    """A rank's RowSparse pieces: k indices (duplicates likely) and small-integer values."""
    rng = np.random.default_rng(1000 * seed + rank)
    indices = rng.integers(0, rows, size=k).astype(index_dtype)
    values = pattern((k, *width_shape), dtype, rank, seed)
    return indices, values


def mpiexec_path():
    """The mpiexec beside this Python (the MPI wheel's) or on PATH; None if absent."""
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                        + os.environ.get("PATH", ""))

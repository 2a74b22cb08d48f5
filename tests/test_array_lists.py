"""mpigrad._base.array_lists: one pass over a list of arrays, in C where it is built,
else numpy's way; both ways give what numpy gives, and C refuses (writing nothing)
whatever it does not handle."""

import os

import numpy as np
import pytest

from mpigrad import Reducer
from mpigrad._base import array_lists
from mpigrad._base.bfloat16 import bfloat16_dtype
from mpigrad._base.native import extension

bfloat16 = bfloat16_dtype()


@pytest.fixture(params=["C", "numpy"])
def way(request, monkeypatch):
    """Each test both ways: the compiled module, and numpy's (as without a compiler)."""
    if request.param == "numpy":
        monkeypatch.setattr(array_lists, "native", lambda: None)
    elif array_lists.native() is None:
        if os.environ.get("MPIGRAD_KERNELS", "").lower() == "numba":
            pytest.skip("MPIGRAD_KERNELS=numba: no C asked for")
        pytest.fail(f"array_lists.c did not build: {extension('array_lists')[1]}")
    return request.param


SHAPES = [(3, 4), (0,), (1,), (2, 0, 3), (5,), (2, 3, 2)]
DTYPES = [np.float32, np.float64, np.float16, np.int64, np.complex64, bfloat16, np.bool_]


def _arrays(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 100).astype(dtype) for shape in SHAPES]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_gather_then_scatter_gives_the_arrays_back(way, dtype):
    arrays = _arrays(dtype)
    flat = np.empty(sum(a.size for a in arrays), dtype)
    array_lists.gather(arrays, flat)
    assert flat.tobytes() == np.concatenate([a.reshape(-1) for a in arrays]).tobytes()
    outs = [np.zeros_like(a) for a in arrays]
    done = array_lists.scatter(flat, outs)
    assert done == (way == "C")
    if done:
        assert all(o.tobytes() == a.tobytes() for o, a in zip(outs, arrays))


def test_gather_takes_any_layout_and_dtype_as_numpy_does(way):
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    arrays = [base[:, ::2], np.asfortranarray(base), base.astype(np.float16), base[1]]
    flat = np.empty(sum(a.size for a in arrays), np.float32)
    array_lists.gather(arrays, flat)
    expected = np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in arrays])
    assert np.array_equal(flat, expected)


@pytest.mark.parametrize("case", ["strided", "read-only", "dtype", "sizes", "flat strided"])
def test_scatter_writes_nothing_where_it_cannot_fill_every_array(way, case):
    flat = np.arange(12, dtype=np.float32)
    outs = [np.zeros(4, np.float32), np.zeros((2, 2), np.float32), np.zeros(4, np.float32)]
    if case == "strided":
        outs[2] = np.zeros(8, np.float32)[::2]
    elif case == "read-only":
        outs[2].flags.writeable = False
    elif case == "dtype":
        outs[2] = np.zeros(4, np.float64)
    elif case == "sizes":
        outs[2] = np.zeros(3, np.float32)
    else:
        flat = np.arange(24, dtype=np.float32)[::2]
    assert not array_lists.scatter(flat, outs)
    assert all(not o.any() for o in outs)


class _Sub(np.ndarray):
    pass


def _variants():
    """Lists of arrays alike and not: each differs from the first in one respect."""
    f4 = np.zeros((2, 3), np.float32)
    return [
        [f4, np.zeros(5)],
        [np.ones((2, 3), np.float32), np.ones(5)],                  # the same signature
        [np.zeros((3, 2), np.float32), np.zeros(5)],                # shape
        [np.zeros(6, np.float32), np.zeros(5)],                     # dimensions
        [np.zeros((2, 3), np.int32), np.zeros(5)],                  # dtype, same size
        [np.zeros((2, 3), ">f4"), np.zeros(5)],                     # byte order
        [np.zeros((2, 3), np.float64), np.zeros(5)],                # item size
        [np.zeros((2, 3), bfloat16), np.zeros(5)],                  # a user dtype
        [np.zeros((2, 3), np.float16), np.zeros(5)],
        [f4, np.zeros(5), np.zeros(0)],                             # one array more
        [f4],
        [],
    ]


def _signature_tuple(arrays):
    return tuple((type(a), a.shape, a.dtype) for a in arrays)


def test_signatures_are_equal_exactly_where_classes_dtypes_and_shapes_are(way):
    variants = _variants()
    keys = [array_lists.signature(v) for v in variants]
    if way == "numpy":
        assert keys == [None] * len(keys)
        return
    assert all(isinstance(k, bytes) for k in keys)
    for a, ka in zip(variants, keys):
        for b, kb in zip(variants, keys):
            assert (ka == kb) == (_signature_tuple(a) == _signature_tuple(b)), (a, b)


@pytest.mark.parametrize("odd", [
    np.zeros(3).view(_Sub), np.ma.zeros(3), np.zeros(3, "U2"), np.zeros(3, object),
    np.zeros(3, "datetime64[s]"), np.zeros(3, [("a", "f4")]), 3.0, [1.0]])
def test_anything_else_has_no_signature(way, odd):
    assert array_lists.signature([np.zeros(3), odd]) is None


def test_writeable_and_owned_apart_say_what_numpy_says(way):
    a, b = np.zeros(4), np.zeros(4)
    read_only = np.zeros(4)
    read_only.flags.writeable = False
    assert array_lists.writeable([a, b]) and not array_lists.writeable([a, read_only])
    assert array_lists.writeable([])
    assert array_lists.owned_apart([a, b]) and array_lists.owned_apart([])
    assert not array_lists.owned_apart([a, b, a])                  # given twice
    assert not array_lists.owned_apart([a, b[1:]])                 # a view
    assert not array_lists.owned_apart([a, np.frombuffer(b"\0" * 8)])
    many = [np.zeros(1) for _ in range(1000)]
    assert array_lists.owned_apart(many)
    for i, j in ((0, 999), (998, 999), (500, 3)):         # many[j] replaced by many[i]
        assert not array_lists.owned_apart(many[:j] + [many[i]] + many[j + 1:])


@pytest.mark.parametrize("odd", [np.zeros(3).view(_Sub), np.ma.zeros(3), 3.0, None])
def test_exactly_numpy_tells_numpy_arrays_from_anything_else(way, odd):
    arrays = [np.zeros(3), np.zeros((2, 2), np.float16)]
    assert array_lists.exactly_numpy(arrays) and array_lists.exactly_numpy([])
    assert not array_lists.exactly_numpy(arrays + [odd])
    assert not array_lists.exactly_numpy((odd,) + tuple(arrays))


def test_a_reducer_of_many_arrays_gives_the_same_bits_both_ways(way):
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(s).astype(np.float32) for s in [(7,), (3, 5), (0,), (64,)] * 50]
    expected = [g.copy() for g in grads]
    reducer = Reducer(mean=False)
    try:
        reducer.reduce(grads, inplace=True)
        out = reducer.reduce(grads)
    finally:
        reducer.free()
    assert all(g.tobytes() == e.tobytes() for g, e in zip(grads, expected))
    assert all(o.tobytes() == e.tobytes() for o, e in zip(out, expected))


def _special_values(rng, shape, dtype):
    """Random values with infinities, nan, subnormals and values near overflow."""
    real = np.dtype(dtype).type(0).real.dtype
    info = np.finfo(real)
    pool = np.array([np.inf, -np.inf, np.nan, info.tiny / 4, -info.tiny / 3, info.max,
                     -info.max, 0.0, -0.0], real)
    values = (rng.standard_normal(shape) * 1e3).astype(real)
    picks = rng.random(shape) < 0.3
    values[picks] = rng.choice(pool, picks.sum())
    if np.dtype(dtype).kind == "c":
        out = np.empty(shape, dtype)
        out.real, out.imag = values, values[..., ::-1]
        return out
    return values.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
def test_rows_add_up_to_the_bits_of_numpys_adds_in_order(way, dtype, ranks):
    rng = np.random.default_rng(ranks)
    gathered = _special_values(rng, (ranks, 301), dtype)
    rows = list(gathered)
    expected = rows[0].copy()
    with np.errstate(all="ignore"):
        for row in rows[1:]:
            np.add(expected, row, out=expected)
    out = np.full(301, 7, dtype)
    done = array_lists.add_rows(rows, out)
    assert done == (way == "C")
    if done:
        assert out.tobytes() == expected.tobytes()


@pytest.mark.parametrize("case", ["int", "float16", "strided row", "other dtype", "size",
                                  "overlap", "no rows", "read-only"])
def test_rows_it_cannot_add_are_left_to_numpy(case):
    rows = [np.ones(8, np.float32), np.ones(8, np.float32)]
    out = np.zeros(8, np.float32)
    if case == "int":
        rows, out = [r.astype(np.int32) for r in rows], out.astype(np.int32)
    elif case == "float16":
        rows, out = [r.astype(np.float16) for r in rows], out.astype(np.float16)
    elif case == "strided row":
        rows[1] = np.ones(16, np.float32)[::2]
    elif case == "other dtype":
        rows[1] = np.ones(8, np.float64)
    elif case == "size":
        rows[1] = np.ones(9, np.float32)
    elif case == "overlap":
        out = rows[1][:]
    elif case == "no rows":
        rows = []
    else:
        out.flags.writeable = False
    before = out.copy()
    assert not array_lists.add_rows(rows, out)
    assert out.tobytes() == before.tobytes()

"""Argument validation that needs no peer (runs on one rank too)."""

import numpy as np
import pytest

from mpigrad import Reducer
from mpigrad._base.settings import reproducible_setting, resolve_timeout


@pytest.mark.parametrize("degree", [0, -1, 2.5, True, False, "2"])
def test_bad_degree(degree):
    with pytest.raises(ValueError, match=r"degree.*" + repr(degree).replace(".", r"\.")):
        Reducer(degree=degree)


@pytest.mark.parametrize("bad", [[0], [2, 1], [1, 1], [-3], [1.0], ["a"]])
def test_bad_split_indices_at_construction(bad):
    with pytest.raises(ValueError, match="split_indices"):
        Reducer(split_indices=bad)


def test_split_index_beyond_count_raises_at_reduce():
    with Reducer(split_indices=[2]) as reducer:
        with pytest.raises(ValueError, match="split_indices"):
            reducer.reduce([np.zeros(2, np.float32)] * 2)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, object])
def test_non_float_gradient(dtype):
    grads = [np.zeros(3, np.float32), np.zeros(3, dtype)]
    with Reducer() as reducer:
        with pytest.raises(TypeError, match=r"grads\[1\].*" + np.dtype(dtype).name):
            reducer.reduce(grads)


@pytest.mark.parametrize("item", [[1.0, 2.0], 3.0, None, "grad"])
def test_non_array_gradient(item):
    with Reducer() as reducer:
        with pytest.raises(TypeError, match=r"grads\[0\]: expecting an array"):
            reducer.reduce([item])


def test_grads_must_be_a_list():
    with Reducer() as reducer:
        with pytest.raises(TypeError, match="list or tuple"):
            reducer.reduce(np.zeros(3, np.float32))


def test_skip_of_wrong_length():
    with Reducer(skip=[True, False]) as reducer:
        with pytest.raises(ValueError, match="skip: expecting 3 flags.*got 2"):
            reducer.reduce([np.zeros(1, np.float32)] * 3)


def test_bad_bucket_bytes():
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="bucket_bytes"):
            Reducer(bucket_bytes=bad)


@pytest.mark.parametrize("name, value", [
    ("mean", False), ("degree", 3), ("bucket_bytes", 64), ("split_indices", [1]),
    ("skip", [True]), ("sparse", "gather"), ("check", False), ("timeout", 5.0),
    ("verify", True), ("chunk_bytes", 1024)])
def test_settings_are_read_only(name, value):
    with Reducer() as reducer:
        before = getattr(reducer, name)
        with pytest.raises(AttributeError, match=rf"{name}: .*fixed at construction.*Reducer"):
            setattr(reducer, name, value)
        assert getattr(reducer, name) == before


def test_numpy_integers_accepted_for_every_size_argument():
    with Reducer(degree=np.int64(2), bucket_bytes=np.int32(64), chunk_bytes=np.int64(1 << 20),
                 split_indices=[np.int64(1)]) as reducer:
        assert (reducer.degree, reducer.bucket_bytes, reducer.chunk_bytes,
                reducer.split_indices) == (2, 64, 1 << 20, (1,))
        assert all(type(v) is int for v in (reducer.degree, reducer.bucket_bytes,
                                             reducer.chunk_bytes))


@pytest.mark.parametrize("name", ["degree", "bucket_bytes", "chunk_bytes"])
@pytest.mark.parametrize("bad", [True, np.bool_(True), 0, -4, 2.0])
def test_size_arguments_reject_bools_floats_and_non_positive(name, bad):
    with pytest.raises(ValueError, match=rf"{name}: expecting an int > 0"):
        Reducer(**{name: bad})


def test_size_defaults_from_the_environment_and_arguments_win(monkeypatch):
    monkeypatch.setenv("MPIGRAD_BUCKET_BYTES", "65536")
    monkeypatch.setenv("MPIGRAD_CHUNK_BYTES", "1048576")
    with Reducer() as reducer:
        assert (reducer.bucket_bytes, reducer.chunk_bytes) == (65536, 1 << 20)
        grads = [np.zeros(1 << 14, np.float32)] * 2         # 64 KiB each: a bucket each
        assert [b.indices for b in reducer.plan(grads).buckets] == [(0,), (1,)]
    with Reducer(bucket_bytes=1 << 20, chunk_bytes=1 << 22) as reducer:
        assert (reducer.bucket_bytes, reducer.chunk_bytes) == (1 << 20, 1 << 22)
    monkeypatch.delenv("MPIGRAD_BUCKET_BYTES")
    monkeypatch.delenv("MPIGRAD_CHUNK_BYTES")
    with Reducer() as reducer:
        assert (reducer.bucket_bytes, reducer.chunk_bytes) == (None, 4 << 20)


def test_variables_read_at_every_call_see_each_change_of_os_environ(monkeypatch):
    """MPIGRAD_REPRODUCIBLE and MPIGRAD_TIMEOUT are read at every call (through the
    C library's getenv): each change through os.environ (monkeypatch's too) is seen at
    the next call, and a bad value raises at every call until it is mended."""
    monkeypatch.delenv("MPIGRAD_REPRODUCIBLE", raising=False)
    monkeypatch.delenv("MPIGRAD_TIMEOUT", raising=False)
    assert (reproducible_setting(None), resolve_timeout()) == (False, 600.0)
    monkeypatch.setenv("MPIGRAD_REPRODUCIBLE", " 1 ")
    monkeypatch.setenv("MPIGRAD_TIMEOUT", "7.5")
    assert (reproducible_setting(None), resolve_timeout()) == (True, 7.5)
    monkeypatch.setenv("MPIGRAD_REPRODUCIBLE", "0")
    monkeypatch.setenv("MPIGRAD_TIMEOUT", "0")
    assert (reproducible_setting(None), resolve_timeout()) == (False, None)
    monkeypatch.setenv("MPIGRAD_REPRODUCIBLE", "yes")
    for _ in range(2):
        with pytest.raises(ValueError, match="MPIGRAD_REPRODUCIBLE: expecting 1 or 0"):
            reproducible_setting(None)
    monkeypatch.delenv("MPIGRAD_REPRODUCIBLE")
    monkeypatch.delenv("MPIGRAD_TIMEOUT")
    assert (reproducible_setting(None), resolve_timeout()) == (False, 600.0)
    assert reproducible_setting(True) and resolve_timeout(3) == 3.0       # arguments win


@pytest.mark.parametrize("variable", ["MPIGRAD_BUCKET_BYTES", "MPIGRAD_CHUNK_BYTES"])
@pytest.mark.parametrize("bad", ["0", "-5", "1.5", "lots"])
def test_bad_size_environment_values_are_named(monkeypatch, variable, bad):
    monkeypatch.setenv(variable, bad)
    with pytest.raises(ValueError, match=f"{variable}: expecting an int > 0"):
        Reducer()


@pytest.mark.parametrize("name", ["mean", "check", "verify", "check_finite"])
@pytest.mark.parametrize("bad", ["no", 0, None])
def test_boolean_settings_take_only_bools(name, bad):
    with pytest.raises(ValueError, match=rf"{name}: expecting True or False"):
        Reducer(**{name: bad})

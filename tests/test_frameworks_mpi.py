"""torch and jax arrays in, the same kinds out, equal to the numpy path.
Run under mpiexec -n 2 and -n 3; skipped where torch or jax is not installed."""

import numpy as np
import pytest

from helpers import assert_bitwise_equal, expected, pattern
from mpigrad import Reducer
from mpigrad._base.arrays import numpy_from_torch
from mpigrad._base.dtypes import bfloat16

pytestmark = pytest.mark.mpi(min_size=2)

SHAPES = [(4, 3), (5,), (), (2, 2, 2), (0,)]


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def torch_tensors(torch, comm, dtype):
    numpy_dtype = {torch.float32: np.float32, torch.float16: np.float16,
                   torch.bfloat16: bfloat16, torch.float64: np.float64}[dtype]
    arrays = [pattern(s, numpy_dtype, comm.rank, i) for i, s in enumerate(SHAPES)]
    tensors = [torch.from_numpy(a.astype(np.float32)).to(dtype) for a in arrays]
    return tensors, numpy_dtype


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_torch_cpu_tensors(comm, name, inplace):
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, name)
    tensors, numpy_dtype = torch_tensors(torch, comm, dtype)
    with Reducer() as reducer:
        out = reducer.reduce(tensors, inplace=inplace)
    for i, (o, t, s) in enumerate(zip(out, tensors, SHAPES)):
        assert isinstance(o, torch.Tensor) and o.dtype == dtype and o.device == t.device
        assert (o is t) == inplace
        assert_bitwise_equal(numpy_from_torch(o), expected(s, numpy_dtype, comm.size, i))


def test_torch_parameter_grads_and_requires_grad(comm):
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 3)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(comm.rank + 1))
    grads = [p.grad for p in model.parameters()]
    with Reducer(mean=False) as reducer:
        reducer.reduce(grads, inplace=True)
        total = comm.size * (comm.size + 1) / 2
        assert all(bool((p.grad == total).all()) for p in model.parameters())
        # tensors that require grad themselves: detached views, no BufferError
        leaves = [torch.ones(3, requires_grad=True) * 1, torch.ones(2, requires_grad=True)]
        out = reducer.reduce(leaves)
    assert all(bool((o == comm.size).all()) for o in out)


def test_mixed_numpy_and_torch_list(comm):
    torch = pytest.importorskip("torch")
    a = pattern((6,), np.float32, comm.rank, 0)
    b = torch.from_numpy(pattern((3, 2), np.float16, comm.rank, 1))
    c = pattern((2,), np.float64, comm.rank, 2)
    with Reducer() as reducer:
        out = reducer.reduce([a, b, c])
        skipped = Reducer(skip=[False, True, False])
        kept = skipped.reduce([a, b, c])
        skipped.free()
    assert isinstance(out[0], np.ndarray) and isinstance(out[1], torch.Tensor)
    assert_bitwise_equal(out[0], expected((6,), np.float32, comm.size, 0))
    assert_bitwise_equal(out[1].numpy(), expected((3, 2), np.float16, comm.size, 1))
    assert_bitwise_equal(out[2], expected((2,), np.float64, comm.size, 2))
    assert kept[1] is b


def test_torch_overlap_start_wait(comm):
    torch = pytest.importorskip("torch")
    tensors, numpy_dtype = torch_tensors(torch, comm, torch.float32)
    with Reducer(bucket_bytes=16) as reducer:
        handle = reducer.start(tensors)
        for i in reversed(range(len(tensors))):
            handle.ready(i)
        out = handle.wait()
    assert all(o is t for o, t in zip(out, tensors))
    for i, (o, s) in enumerate(zip(out, SHAPES)):
        assert_bitwise_equal(o.numpy(), expected(s, np.float32, comm.size, i))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16])
def test_jax_arrays(comm, dtype):
    jnp = pytest.importorskip("jax.numpy")
    jax = pytest.importorskip("jax")
    arrays = [jnp.asarray(pattern(s, dtype, comm.rank, i)) for i, s in enumerate(SHAPES)]
    with Reducer() as reducer:
        out = reducer.reduce(arrays)
    for i, (o, a, s) in enumerate(zip(out, arrays, SHAPES)):
        assert isinstance(o, jax.Array) and o.dtype == a.dtype and o.devices() == a.devices()
        assert_bitwise_equal(np.asarray(o), expected(s, dtype, comm.size, i))


def test_jax_inplace_is_a_clear_error_on_every_rank(comm):
    jnp = pytest.importorskip("jax.numpy")
    from mpigrad import PeerError
    grads = [np.ones(3, np.float32)]
    if comm.rank == 0:
        grads = [jnp.ones(3, np.float32)]
    with Reducer() as reducer:
        if comm.rank == 0:
            with pytest.raises(TypeError, match="jax arrays are immutable"):
                reducer.reduce(grads, inplace=True)
        else:
            with pytest.raises(PeerError, match="jax arrays are immutable"):
                reducer.reduce(grads, inplace=True)


def test_reduce_inside_jax_jit_is_mpigrads_error_naming_the_fix(comm):
    """jax tracers hold no values: the error says where reduce belongs
    (every rank traces, so every rank raises; the next call works)."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    with Reducer() as reducer:
        with pytest.raises(TypeError, match="inside jax.jit use mpigrad.jax.reduce"):
            jax.jit(lambda g: reducer.reduce([g])[0])(jnp.ones(3, np.float32))
        out = reducer.reduce([jnp.full(3, comm.rank + 1.0, np.float32)])
    assert np.asarray(out[0]).tolist() == [(comm.size + 1) / 2] * 3


def test_torch_tensors_of_bucket_view_memory_are_reduced_without_a_copy(comm, monkeypatch):
    torch = pytest.importorskip("torch")
    from mpigrad._engine.buffers import BucketBuffers
    like = [np.zeros((4, 3), np.float32), np.zeros(7, np.float32), np.zeros(5, np.float64)]
    with Reducer(comm, bucket_bytes=64) as reducer:
        views = reducer.bucket_views(like)
        copies = []
        for name in ("pack", "gather", "unpack", "unpack_new"):
            monkeypatch.setattr(BucketBuffers, name,
                                lambda self, *a, _name=name, **k: copies.append(_name))
        for make in (torch.from_numpy, lambda v: v.view(), lambda v: torch.from_numpy(v).detach()):
            for view in views:
                view[...] = comm.rank + 1
            out = reducer.reduce([make(v) for v in views], inplace=True)
            assert copies == []
            for got, view in zip(out, views):
                assert (np.asarray(got) == (comm.size + 1) / 2).all() and (view == got).all()

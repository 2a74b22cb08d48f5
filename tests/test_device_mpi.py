"""The device path on fake device arrays (host memory exposed as device
memory: tests/fake_device.py), at 2 and 3 ranks, against references computed
from the rank count: cupy-like, torch-CUDA-like and DLPack-device-like
arrays, staged through host memory (one copy each way per call, whatever the
number of arrays) and summed in device memory by a device-aware MPI (forced
with MPIGRAD_DEVICE_MPI=1: no copy through the host); in place and into new
arrays, the mean and the sum, half precision, producers' streams
synchronized once; the detection (CPU MPIs: not device-aware) and a rank
whose MPI differs named on every rank. Run under mpiexec -n 2 and -n 3."""

import numpy as np
import pytest
from mpi4py import MPI

import fake_device
import mpigrad
from mpigrad._base import device
from mpigrad._comm.device_mpi import device_support

pytestmark = pytest.mark.mpi(min_size=2)

RANK, SIZE = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
KINDS = sorted(fake_device.LIBRARIES)
SHAPES = [(3, 5), (7,), (2, 2, 4), (1,), (0,)]


@pytest.fixture(autouse=True)
def host_as_device():
    runtime = device.HostRuntime()
    device.set_runtime(runtime)
    device.COPIES.clear()
    yield runtime
    device.set_runtime(None)


@pytest.fixture(params=["staged", "aware"])
def mode(request, monkeypatch):
    monkeypatch.setenv("MPIGRAD_DEVICE_MPI", "1" if request.param == "aware" else "0")
    return request.param


def grads_of(rank, dtype=np.float32):
    return [(np.arange(int(np.prod(s))).reshape(s) * (k + 1) + 10 * rank).astype(dtype)
            for k, s in enumerate(SHAPES)]


def reference(mean, dtype=np.float32):
    total = [sum(g.astype(np.float64) for g in parts)
             for parts in zip(*(grads_of(r) for r in range(SIZE)))]
    return [(t / SIZE if mean else t).astype(dtype) for t in total]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mean", [True, False])
def test_new_arrays_of_the_callers_kind(kind, mean, mode):
    grads = [fake_device.make(kind, g) for g in grads_of(RANK)]
    with mpigrad.Reducer(mean=mean) as reducer:
        outs = reducer.reduce(grads)
    for out, grad, want, given in zip(outs, grads, reference(mean), grads_of(RANK)):
        assert type(out) is type(grad) and out is not grad
        np.testing.assert_array_equal(fake_device.values(out), want)
        np.testing.assert_array_equal(fake_device.values(grad), given)   # left as it was
    staged = mode == "staged"
    assert device.COPIES["stage"] == device.COPIES["unstage"] == (1 if staged else 0)
    moved = sum(1 for s in SHAPES if np.prod(s))
    assert device.COPIES["pack"] == device.COPIES["unpack"] == moved


@pytest.mark.parametrize("kind", KINDS)
def test_in_place_the_arrays_themselves(kind, mode, host_as_device):
    grads = [fake_device.make(kind, g) for g in grads_of(RANK)]
    with mpigrad.Reducer() as reducer:
        for step in range(3):                        # buffers kept: the same copies each call
            for grad, g in zip(grads, grads_of(RANK)):
                if grad.size:
                    grad.data[...] = g
            outs = reducer.reduce(grads, inplace=True)
            assert all(out is grad for out, grad in zip(outs, grads))
            for grad, want in zip(grads, reference(True)):
                np.testing.assert_array_equal(fake_device.values(grad), want)
    assert device.COPIES["stage"] == (3 if mode == "staged" else 0)
    if kind == "fakecupy":          # its producer's stream, synchronized once a call
        assert host_as_device.synchronized[fake_device.CupyLike.stream] == 3


def test_half_precision_is_staged_and_summed_in_float32(mode):
    grads = [fake_device.make("fakecupy", g) for g in grads_of(RANK, np.float16)]
    with mpigrad.Reducer() as reducer:
        outs = reducer.reduce(grads)
    for out, want in zip(outs, reference(True, np.float16)):
        assert out.dtype == np.float16
        np.testing.assert_array_equal(fake_device.values(out), want)
    assert device.COPIES["stage"] == device.COPIES["unstage"] == 1


def test_a_torch_like_tensor_that_requires_grad_is_read_detached(mode):
    grads = [fake_device.TorchLike(g, requires_grad=True) for g in grads_of(RANK)]
    with mpigrad.Reducer() as reducer:
        outs = reducer.reduce(grads, inplace=True)
    for out, want in zip(outs, reference(True)):
        np.testing.assert_array_equal(fake_device.values(out), want)


def test_host_and_device_arrays_in_one_call(mode):
    host = grads_of(RANK)
    grads = [fake_device.make("fakedlpack", g) if k % 2 else g for k, g in enumerate(host)]
    with mpigrad.Reducer() as reducer:
        outs = reducer.reduce(grads)
    for k, (out, want) in enumerate(zip(outs, reference(True))):
        assert isinstance(out, np.ndarray) == (k % 2 == 0)
        np.testing.assert_array_equal(fake_device.values(out), want)
    assert device.COPIES["stage"] == device.COPIES["unstage"] == 1


def test_resnet50s_161_gradients_stage_in_one_copy_each_way():
    from mpigrad.bench.layouts import load_layout
    shapes = load_layout("resnet50")
    assert len(shapes) == 161
    grads = [fake_device.make("fakecupy", np.full(s, RANK + 1.0, np.float32)) for s in shapes]
    with mpigrad.Reducer() as reducer:
        buckets = len(reducer.plan([fake_device.values(g) for g in grads]).buckets)
        reducer.reduce(grads, inplace=True)
    assert device.COPIES["stage"] + device.COPIES["unstage"] == 2 <= 2 * buckets
    assert all(fake_device.values(g)[(0,) * len(g.shape)] == (SIZE + 1) / 2 for g in grads)


def test_cpu_mpi_is_not_device_aware_and_the_switch_overrides(monkeypatch):
    monkeypatch.delenv("MPIGRAD_DEVICE_MPI", raising=False)
    found = device_support()
    assert not found.aware and "MPIX_" in found.how
    monkeypatch.setenv("MPIGRAD_DEVICE_MPI", "1")
    assert device_support().aware and device_support().cuda
    monkeypatch.setenv("MPIGRAD_DEVICE_MPI", "maybe")
    with pytest.raises(ValueError, match="expecting 0 or 1"):
        device_support()


def test_a_rank_whose_mpi_differs_is_named_on_every_rank(monkeypatch):
    monkeypatch.setenv("MPIGRAD_DEVICE_MPI", "1" if RANK == 0 else "0")
    grads = [fake_device.make("fakecupy", g) for g in grads_of(RANK)]
    with mpigrad.Reducer() as reducer:
        with pytest.raises(mpigrad.StructureMismatchError, match="device"):
            reducer.reduce(grads)

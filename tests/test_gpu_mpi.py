"""Device arrays (cupy, torch CUDA, jax on a GPU): results equal to the numpy
reference, kinds kept, each result on the device (by index) of its input, in
place and not. Marked gpu. Whether to skip is decided on every rank together
(one rank without a device skips the test everywhere), so that no rank enters a
collective alone. Run under mpiexec -n 2; ranks use device rank % count."""

import numpy as np
import pytest

from helpers import assert_bitwise_equal, expected, pattern
from mpigrad import Reducer
from mpigrad._base.dtypes import bfloat16

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.gpu]

SHAPES = [(64, 33), (5,), (), (1000,)]


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def skip_unless_everywhere(comm, reason):
    """Skip on every rank if any rank has a reason to (None: no reason)."""
    reasons = [r for r in comm.allgather(reason) if r is not None]
    if reasons:
        pytest.skip(f"skipped on every rank: {reasons[0]}")


def _cupy_device(comm):
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except ImportError:
        return None, "cupy is not installed"
    except Exception as exc:                    # noqa: BLE001  (no driver, no device)
        return None, f"no CUDA device for cupy ({exc})"
    if count == 0:
        return None, "no CUDA device for cupy"
    return cupy.cuda.Device(comm.rank % count), None


def cupy_device(comm):
    device, reason = _cupy_device(comm)
    skip_unless_everywhere(comm, reason)
    import cupy
    return cupy, device


def torch_device(comm):
    try:
        import torch
        reason = None if torch.cuda.is_available() else "no CUDA device for torch"
    except ImportError:
        torch, reason = None, "torch is not installed"
    skip_unless_everywhere(comm, reason)
    return torch, torch.device("cuda", comm.rank % torch.cuda.device_count())


def jax_device(comm):
    try:
        import jax
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        reason = None if gpus else "no GPU device for jax"
    except (ImportError, RuntimeError) as exc:
        jax, gpus, reason = None, [], f"jax has no GPU ({exc})"
    skip_unless_everywhere(comm, reason)
    return jax, gpus[comm.rank % len(gpus)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_cupy_arrays(comm, dtype, inplace):
    cupy, device = cupy_device(comm)
    with device:
        arrays = [cupy.asarray(pattern(s, dtype, comm.rank, i)) for i, s in enumerate(SHAPES)]
    with Reducer(bucket_bytes=4096) as reducer:
        out = reducer.reduce(arrays, inplace=inplace)
    for i, (o, a, s) in enumerate(zip(out, arrays, SHAPES)):
        assert isinstance(o, cupy.ndarray) and (o is a) == inplace
        assert o.device.id == a.device.id == device.id
        assert_bitwise_equal(cupy.asnumpy(o), expected(s, dtype, comm.size, i))


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_torch_cuda_tensors(comm, name, inplace):
    torch, device = torch_device(comm)
    dtype = getattr(torch, name)
    numpy_dtype = {"bfloat16": bfloat16, "float16": np.float16}.get(name, np.float32)
    tensors = [torch.from_numpy(pattern(s, np.float32, comm.rank, i)).to(dtype).to(device)
               for i, s in enumerate(SHAPES)]
    with Reducer() as reducer:
        out = reducer.reduce(tensors, inplace=inplace)
    for i, (o, t, s) in enumerate(zip(out, tensors, SHAPES)):
        assert (o is t) == inplace and o.dtype == dtype
        assert o.device.type == "cuda" and o.device.index == t.device.index == device.index
        want = expected(s, numpy_dtype, comm.size, i).astype(np.float32)
        assert_bitwise_equal(o.float().cpu().numpy(), want)


def test_jax_gpu_arrays(comm):
    jax, device = jax_device(comm)
    arrays = [jax.device_put(pattern(s, np.float32, comm.rank, i), device)
              for i, s in enumerate(SHAPES)]
    with Reducer() as reducer:
        out = reducer.reduce(arrays)
    for i, (o, s) in enumerate(zip(out, SHAPES)):
        assert list(o.devices()) == [device]
        assert_bitwise_equal(np.asarray(o), expected(s, np.float32, comm.size, i))


def test_resnet50s_cupy_gradients_cross_the_bus_once_each_way_or_not_at_all(comm):
    """ResNet-50's 161 gradients as cupy arrays, in place: staged (an MPI that
    is not CUDA-aware) in one device-to-host and one host-to-device transfer;
    summed in device memory (a CUDA-aware MPI) with none; the mean right."""
    from mpigrad._base import device as device_path
    from mpigrad._comm.device_mpi import device_support
    from mpigrad.bench.layouts import load_layout
    cupy, device = cupy_device(comm)
    shapes = load_layout("resnet50")
    with device:
        grads = [cupy.full(s, comm.rank + 1.0, cupy.float32) for s in shapes]
    device_path.COPIES.clear()
    with Reducer() as reducer:
        reducer.reduce(grads, inplace=True)
    transfers = device_path.COPIES["stage"] + device_path.COPIES["unstage"]
    assert transfers == (0 if device_support().aware else 2)
    assert all(float(g.ravel()[0]) == (comm.size + 1) / 2 for g in grads)

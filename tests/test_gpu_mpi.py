"""Device arrays (cupy, torch CUDA): results equal to the host path, kinds and
devices kept. Marked gpu; skipped cleanly without cupy/torch CUDA or a device.
Run under mpiexec -n 2 (ranks may share one GPU)."""

import numpy as np
import pytest

from helpers import assert_bitwise_equal, expected, pattern
from mpigrad import Reducer
from mpigrad.dtypes import bfloat16

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.gpu]

SHAPES = [(64, 33), (5,), (), (1000,)]


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def cupy_or_skip():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    return cupy


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_cupy_arrays(comm, dtype, inplace):
    cupy = cupy_or_skip()
    arrays = [cupy.asarray(pattern(s, dtype, comm.rank, i)) for i, s in enumerate(SHAPES)]
    with Reducer(bucket_bytes=4096) as reducer:
        out = reducer.reduce(arrays, inplace=inplace)
    for i, (o, a, s) in enumerate(zip(out, arrays, SHAPES)):
        assert isinstance(o, cupy.ndarray) and o.device == a.device and (o is a) == inplace
        assert_bitwise_equal(cupy.asnumpy(o), expected(s, dtype, comm.size, i))


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_torch_cuda_tensors(comm, name):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    dtype = getattr(torch, name)
    numpy_dtype = bfloat16 if name == "bfloat16" else np.float32
    tensors = [torch.from_numpy(pattern(s, np.float32, comm.rank, i)).to(dtype).cuda()
               for i, s in enumerate(SHAPES)]
    with Reducer() as reducer:
        out = reducer.reduce(tensors, inplace=True)
    for i, (o, t, s) in enumerate(zip(out, tensors, SHAPES)):
        assert o is t and o.is_cuda
        want = expected(s, numpy_dtype, comm.size, i).astype(np.float32)
        assert_bitwise_equal(o.float().cpu().numpy(), want)

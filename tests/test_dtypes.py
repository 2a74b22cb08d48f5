import numpy as np
import pytest

from mpigrad._base.dtypes import bfloat16, check_gradient_dtype, wire_dtype


@pytest.mark.parametrize("dtype, wire", [
    (np.float16, np.float32), (bfloat16, np.float32), (np.float32, np.float32),
    (np.float64, np.float64), (np.complex64, np.complex64),
    (np.complex128, np.complex128)])
def test_wire_dtype_never_casts_down(dtype, wire):
    assert wire_dtype(dtype) == np.dtype(wire)
    assert np.dtype(wire).itemsize >= np.dtype(dtype).itemsize


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, object, np.uint8])
def test_non_float_dtypes_rejected_with_index(dtype):
    with pytest.raises(TypeError, match=r"grads\[4\].*" + np.dtype(dtype).name):
        check_gradient_dtype(np.dtype(dtype), 4)

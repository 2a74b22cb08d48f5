import numpy as np
import pytest

from mpigrad.dtypes import bfloat16, check_gradient_dtype, copy_into, scale_into, wire_dtype


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


@pytest.mark.parametrize("half", [np.float16, bfloat16])
def test_half_upcast_and_back_is_exact(half):
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = bits.view(half)
    wide = np.empty(values.shape, np.float32)
    back = np.empty_like(values)
    with np.errstate(invalid="ignore"):
        copy_into(wide, values)
        scale_into(back, wide, None)
    finite = np.isfinite(values.astype(np.float32))
    assert np.array_equal(back.view(np.uint16)[finite], bits[finite])
    assert np.isnan(back.astype(np.float32)[np.isnan(values.astype(np.float32))]).all()


def test_scale_rounds_once_from_wire_dtype():
    src = np.array([3.0, 1.0, 65504.0 * 2], np.float32)
    out = np.empty(3, np.float16)
    scale_into(out, src, np.float32(1 / 3))
    want = (src * np.float32(1 / 3)).astype(np.float16)
    assert np.array_equal(out, want)

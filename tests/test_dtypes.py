import subprocess
import sys

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


def test_ml_dtypes_is_imported_at_the_first_bfloat16_not_with_mpigrad():
    """importing ml_dtypes takes 0.6 s, three times the rest of ``import mpigrad``"""
    probe = ("import sys, numpy as np, mpigrad\n"
             "from mpigrad._base.dtypes import check_gradient_dtype, finite_limit, wire_dtype\n"
             "check_gradient_dtype(np.float16, 0)\n"
             "assert wire_dtype(np.float16) == np.float32 and finite_limit([np.float32]) > 1e308\n"
             "assert 'ml_dtypes' not in sys.modules, 'imported with mpigrad'\n"
             "assert mpigrad.bfloat16.name == 'bfloat16' and 'ml_dtypes' in sys.modules\n"
             "assert finite_limit([mpigrad.bfloat16]) < 3.4e38\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16, np.uint8, np.complex64])
def test_an_arrays_address_is_numpys_for_every_dtype_and_layout(dtype):
    """``address`` reads bfloat16 arrays through their bits' view (the buffer protocol
    cannot describe ml_dtypes' dtypes): the same address as numpy's, whatever the layout"""
    from mpigrad._base.address import address
    base = np.zeros((6, 4), dtype)
    read_only = base.copy()
    read_only.flags.writeable = False
    for array in (base, base[1:], base[:, 1:], base[::2], base.T, read_only, base[:0]):
        assert address(array) == array.ctypes.data

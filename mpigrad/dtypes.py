"""Wire-dtype policy and the casts between gradient and wire dtypes.

Half precision (float16, bfloat16) travels as float32; float32, float64 and the
complex types travel as they are, so no gradient is ever cast down.
"""

import ml_dtypes
import numpy as np

__all__ = ["bfloat16", "SUPPORTED", "wire_dtype", "check_gradient_dtype"]

bfloat16 = np.dtype(ml_dtypes.bfloat16)

_WIRE = {
    np.dtype(np.float16): np.dtype(np.float32),
    bfloat16: np.dtype(np.float32),
    np.dtype(np.float32): np.dtype(np.float32),
    np.dtype(np.float64): np.dtype(np.float64),
    np.dtype(np.complex64): np.dtype(np.complex64),
    np.dtype(np.complex128): np.dtype(np.complex128),
}

SUPPORTED = tuple(_WIRE)
_SUPPORTED_NAMES = ", ".join(d.name for d in SUPPORTED)


def wire_dtype(dtype):
    """The dtype a gradient of ``dtype`` is reduced in."""
    return _WIRE[np.dtype(dtype)]


def check_gradient_dtype(dtype, index):
    """Raise TypeError unless ``dtype`` is a gradient dtype mpigrad reduces."""
    if np.dtype(dtype) not in _WIRE:
        raise TypeError(
            f"grads[{index}]: expecting a floating or complex dtype "
            f"({_SUPPORTED_NAMES}), got {np.dtype(dtype).name}; "
            "cast it first or mark it in skip=")


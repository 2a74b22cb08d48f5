"""The address of an array's memory, taken fast: numpy's ``ndarray.ctypes.data`` builds
a ctypes helper object each time (1.4 us here, three times what this takes), and the
node sums' loops take addresses by the hundred per call."""

import ctypes

import numpy as np

__all__ = ["address"]

#: the unsigned integers of each size: the bits' view of a dtype the buffer protocol
#: cannot describe (ml_dtypes' bfloat16: numpy builds a format string and raises, 4 us)
_BITS = {d.itemsize: d for d in map(np.dtype, (np.uint8, np.uint16, np.uint32, np.uint64))}


def address(array: np.ndarray) -> int:
    """The address of ``array``'s first element (``array.ctypes.data``): through the
    buffer protocol where it is writable and C-contiguous, else numpy's way."""
    if array.dtype.kind == "V" and array.dtype.itemsize in _BITS:
        array = array.view(_BITS[array.dtype.itemsize])
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))   # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError):      # read-only, strided or empty
        return int(array.ctypes.data)

"""Arrays as the bytes MPI moves: a C-contiguous array's flat byte view, and
consecutive pieces of a received buffer back into arrays."""

from typing import Sequence

import numpy as np

__all__ = ["as_bytes", "unpack"]


def as_bytes(array: np.ndarray) -> np.ndarray:
    """The C-contiguous ``array``'s bytes, as a flat uint8 view."""
    return array.reshape(-1).view(np.uint8)


def unpack(received: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    """Consecutive pieces of the bytes ``received`` into the byte views ``arrays``."""
    offset = 0
    for array in arrays:
        array[...] = received[offset:offset + array.size]
        offset += array.size

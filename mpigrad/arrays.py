"""Array-kind adapter: what mpigrad accepts as a gradient, and how it comes back."""

import numpy as np

__all__ = ["as_array"]


def as_array(grad, index):
    """The numpy array behind gradient ``index``; TypeError for anything else."""
    if isinstance(grad, np.ndarray):
        return grad
    raise TypeError(f"grads[{index}]: expecting an array, got {type(grad).__name__}")


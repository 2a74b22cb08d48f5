"""numpy's bfloat16 (ml_dtypes'), imported at its first need: importing
ml_dtypes takes 0.6 s, more than the rest of mpigrad, and most programs never
see a bfloat16 (a program that has one has imported ml_dtypes already)."""

import functools

import numpy as np

__all__ = ["bfloat16_dtype", "dtype_named", "is_bfloat16"]


@functools.lru_cache(maxsize=None)
def bfloat16_dtype() -> np.dtype:
    """ml_dtypes' bfloat16, as a numpy dtype."""
    import ml_dtypes
    dtype: np.dtype = np.dtype(ml_dtypes.bfloat16)
    return dtype


def dtype_named(name: str) -> np.dtype:
    """The numpy dtype ``name`` names ("bfloat16": ml_dtypes')."""
    return bfloat16_dtype() if name == "bfloat16" else np.dtype(name)


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16 (ml_dtypes is imported only for
    a dtype of that name; the kind first: ``dtype.name`` is built in Python, the cost
    of a torch tensor's wrap where a call hands back hundreds)."""
    return dtype.kind == "V" and dtype.name == "bfloat16" and dtype == bfloat16_dtype()

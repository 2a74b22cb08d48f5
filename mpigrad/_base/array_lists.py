"""Work over a list of numpy arrays in one call: copied end to end into one flat
array and back, the signature a plan is found by, the checks of an in-place call.

A call of a thousand small gradients touches each array a few times in Python,
about 0.1 us a touch; here each is one pass in C (``array_lists.c``, a CPython
extension built at first use, mpigrad._base.native.extension), and numpy's way
where it is not built (no compiler, ``MPIGRAD_KERNELS=numba``) or an array is
not what C handles (not C-contiguous, another dtype; the results the same).
"""

import operator
from itertools import repeat
from typing import Any, Optional, Sequence

import numpy as np

from .native import extension

__all__ = ["exactly_numpy", "gather", "scatter", "add_rows", "signature", "writeable",
           "own_memory", "owned_apart", "native"]

_WRITEABLE = operator.attrgetter("flags.writeable")
_BASE = operator.attrgetter("base")
_NUMPY_ONLY = {np.ndarray}


def native() -> Any:
    """The compiled module, or None (numpy's way)."""
    return extension("array_lists")[0]


def exactly_numpy(items: Sequence[Any]) -> bool:
    """Whether every one of ``items`` is exactly a numpy array (no subclass)."""
    lib = native()
    return bool(lib.exactly_numpy(items)) if lib is not None else \
        set(map(type, items)) <= _NUMPY_ONLY


def gather(arrays: Sequence[np.ndarray], flat: np.ndarray) -> None:
    """``arrays`` end to end into the 1-D ``flat`` (its size theirs together), in
    C order, cast to ``flat``'s dtype: ``np.concatenate(arrays, out=flat)``."""
    lib = native()
    if lib is None or not lib.gather(arrays, flat):
        np.concatenate(arrays, axis=None, out=flat)


def scatter(flat: np.ndarray, arrays: Sequence[np.ndarray]) -> bool:
    """``flat`` end to end into ``arrays`` (C-contiguous, writeable, of its dtype,
    their sizes its own together) in one pass, where C is built; False where not
    done (the caller copies)."""
    lib = native()
    return lib is not None and bool(lib.scatter(arrays, flat))


def add_rows(rows: Sequence[np.ndarray], out: np.ndarray) -> bool:
    """``out`` = ``rows[0] + rows[1] + ...`` in that order, one rounding per add (as
    numpy's adds, row after row), overflow and nan unreported (as MPI's sum), in one
    call where C is built and the arrays are float32, float64 or complex (each of
    ``out``'s dtype and size, C-contiguous, apart from it; at most 64 rows); False
    where not done (the caller sums)."""
    lib = native()
    return lib is not None and bool(lib.add_rows(rows, out))


def signature(arrays: Sequence[Any]) -> Optional[bytes]:
    """Bytes equal for two sequences of numpy arrays (of exactly ``np.ndarray``, of
    numeric or bfloat16 dtypes) exactly where their dtypes and shapes are equal,
    one by one; None where C is not built or an item is anything else (the caller
    keys by (class, shape, dtype) tuples)."""
    lib = native()
    key: Optional[bytes] = None if lib is None else lib.signature(arrays)
    return key


def writeable(arrays: Sequence[np.ndarray]) -> bool:
    """Whether every one of ``arrays`` is writeable."""
    lib = native()
    answer = None if lib is None else lib.writeable(arrays)
    return all(map(_WRITEABLE, arrays)) if answer is None else bool(answer)


def own_memory(arrays: Sequence[np.ndarray]) -> bool:
    """Whether every one of ``arrays`` owns its memory (has no base: is no view)."""
    return all(map(operator.is_, map(_BASE, arrays), repeat(None)))


def owned_apart(arrays: Sequence[np.ndarray]) -> bool:
    """Whether ``arrays`` cannot share memory by how they were made: each owns its
    memory (no base) and no array is given twice."""
    lib = native()
    answer = None if lib is None else lib.owned_apart(arrays)
    if answer is None:
        return own_memory(arrays) and len(set(map(id, arrays))) == len(arrays)
    return bool(answer)

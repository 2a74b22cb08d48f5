"""Collectives as a face makes them, and the references of their reductions,
for the collective layer's tests."""

import numpy as np

from mpigrad._base.description import array_item
from mpigrad._collective import Collective


def spec(kind, name, sends=(), recvs=(), shapes=True, items=None, **fields):
    """A Collective as a face makes it: its arrays' items named for the agreement
    (``items``, else each send's), with their shapes, or (``shapes=False``: a row
    gather's, an all-to-all's, whose sizes may differ across ranks) their dtypes
    only."""
    if items is None:
        items = tuple(array_item(a.dtype, a.shape) if shapes else a.dtype.name for a in sends)
    return Collective(kind, name, tuple(sends), tuple(recvs), items=items, **fields)


#: each op of the table as numpy reduces a stack of every rank's addends
_REDUCED = {"sum": np.sum, "mean": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


def reduced(op, stack):
    """``op`` over ``stack``'s rows (every rank's addends, in float64: exact here),
    the mean divided by the rank count."""
    total = _REDUCED[op](stack, axis=0)
    return total * (1.0 / len(stack)) if op == "mean" else total

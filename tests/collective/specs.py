"""Collectives as a face makes them, for the collective layer's tests."""

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

"""MindSpore's tensors as numpy arrays and back, sharing memory where
MindSpore does: on CPU ``Tensor.asnumpy()`` is a view of the tensor's memory
and ``Tensor.from_numpy`` keeps the array (and a reference to it) as its
own, so neither copies; bfloat16 crosses over through its bits."""

from typing import Any

import mindspore as ms
import numpy as np

from .._base.bfloat16 import bfloat16_dtype
from .._base.row_sparse import RowSparse

__all__ = ["ROW_TENSORS", "to_numpy", "to_tensor", "to_row_sparse", "to_row_tensor",
           "from_mindspore_bfloat16"]

#: MindSpore's row-sparse gradients: the public RowTensor and the RowTensorInner
#: its sparse lookups' gradients are in graph mode (not subclasses of each other)
ROW_TENSORS = (ms.RowTensor, ms.common.RowTensorInner)


#: the numpy dtype of MindSpore's bfloat16 tensors' ``asnumpy()`` (its own, not ml_dtypes')
_BFLOAT16 = ms.Tensor(np.zeros(1, np.float32)).astype(ms.bfloat16).asnumpy().dtype


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy view of a CPU ``tensor`` (bfloat16 as ml_dtypes' bfloat16)."""
    return from_mindspore_bfloat16(tensor.asnumpy())


def from_mindspore_bfloat16(array: np.ndarray) -> np.ndarray:
    """``array`` of MindSpore's numpy bfloat16 viewed as ml_dtypes' (the same bits);
    any other as it is."""
    if array.dtype == _BFLOAT16:
        return array.view(np.uint16).view(bfloat16_dtype())
    return array


def to_tensor(array: np.ndarray) -> Any:
    """A MindSpore tensor holding ``array`` (not a copy)."""
    return ms.Tensor.from_numpy(array)


def to_row_sparse(grad: Any) -> RowSparse:
    """mpigrad's RowSparse of a RowTensor's indices, values and dense shape."""
    return RowSparse(to_numpy(grad.indices), to_numpy(grad.values), tuple(grad.dense_shape))


def to_row_tensor(rows: RowSparse, like: Any) -> Any:
    """A row tensor of ``like``'s class (and index dtype) holding ``rows``."""
    indices = rows.indices.astype(to_numpy(like.indices).dtype, copy=False)
    return type(like)(to_tensor(indices), to_tensor(rows.values), tuple(rows.dense_shape))

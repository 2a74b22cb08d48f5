"""Row-sparse gradients: a few rows of a dense matrix (pure; reduced by
mpigrad._engine.sparse)."""

from typing import Sequence, Tuple

import numpy as np

from .dtypes import supported, wire_dtype

__all__ = ["RowSparse", "SPARSE_MODES", "scatter_add"]

#: how a Reducer reduces RowSparse gradients (its ``sparse`` setting)
SPARSE_MODES = ("auto", "gather", "dense")


class RowSparse:
    """A gradient holding a few rows of a ``dense_shape`` matrix.

    Args:
        indices: 1-D integer array of ``k`` row numbers in ``[0, dense_shape[0])``
            (duplicates allowed: their rows add up).
        values: array of shape ``[k, *dense_shape[1:]]``, floating or complex.
        dense_shape: the shape of the dense gradient, at least 1-D.
    """

    __slots__ = ("indices", "values", "dense_shape")

    def __init__(self, indices: np.ndarray, values: np.ndarray,
                 dense_shape: Sequence[int]) -> None:
        indices, values = np.asarray(indices), np.asarray(values)
        dense_shape = tuple(int(d) for d in dense_shape)
        if len(dense_shape) < 1 or any(d < 0 for d in dense_shape):
            raise ValueError(f"dense_shape: expecting at least one dimension, none negative, "
                             f"got {dense_shape}")
        if indices.ndim != 1 or indices.dtype.kind not in "iu":
            raise ValueError(f"indices: expecting a 1-D integer array, got "
                             f"{indices.ndim}-D {indices.dtype.name}")
        want = (indices.shape[0], *dense_shape[1:])
        if values.shape != want:
            raise ValueError(f"values: expecting shape {want} (one row per index), "
                             f"got {values.shape}")
        if not supported(values.dtype):
            raise ValueError(f"values: expecting a floating dtype, got {values.dtype.name}")
        if indices.size and (indices.min() < 0 or indices.max() >= dense_shape[0]):
            bad = indices[(indices < 0) | (indices >= dense_shape[0])][0]
            raise ValueError(f"indices: expecting rows in [0, {dense_shape[0]}), got {bad}")
        self.indices, self.values, self.dense_shape = indices, values, dense_shape

    @property
    def nnz(self) -> int:
        """Number of rows held (duplicates counted)."""
        return int(self.indices.shape[0])

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        """The dense shape, as for an array."""
        return self.dense_shape

    def __repr__(self) -> str:
        return (f"RowSparse(nnz={self.nnz}, dense_shape={self.dense_shape}, "
                f"dtype={self.dtype.name}, index dtype={self.indices.dtype.name})")

    def to_dense(self) -> np.ndarray:
        """The dense array; duplicate rows are summed in the wire dtype."""
        dense: np.ndarray = scatter_add(self.indices, self.values, self.dense_shape)
        return dense.astype(self.dtype)

    def coalesce(self) -> "RowSparse":
        """An equal RowSparse with sorted, unique indices (duplicates summed)."""
        rows, inverse = np.unique(self.indices, return_inverse=True)
        summed = scatter_add(inverse, self.values, (rows.size, *self.dense_shape[1:]))
        return RowSparse(rows.astype(self.indices.dtype), summed.astype(self.dtype),
                         self.dense_shape)


def scatter_add(rows: np.ndarray, values: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """A dense array of ``shape`` (in the wire dtype of ``values``) with each
    row of ``values`` added at its row of ``rows``."""
    out = np.zeros(shape, wire_dtype(values.dtype))
    np.add.at(out, rows, values.astype(out.dtype, copy=False))
    return out

"""RowSparse on its own: validation, to_dense, coalesce, the density rule."""

import numpy as np
import pytest

from mpigrad import RowSparse
from mpigrad._base.dtypes import bfloat16
from mpigrad._engine.sparse import gather_is_cheaper


def test_properties_and_to_dense_sums_duplicates():
    rs = RowSparse(np.array([2, 0, 2]), np.array([[1, 2], [3, 4], [5, 6]], np.float32), (4, 2))
    assert rs.nnz == 3 and rs.dtype == np.float32
    assert np.array_equal(rs.to_dense(), [[3, 4], [0, 0], [6, 8], [0, 0]])


def test_coalesce_sorts_and_sums_in_wire_dtype():
    values = np.array([2048, 1, 1], np.float16)     # 2048 + 1 + 1 is exact only in float32
    rs = RowSparse(np.array([3, 3, 3], np.int32), values, (5,)).coalesce()
    assert rs.indices.dtype == np.int32 and rs.indices.tolist() == [3]
    assert rs.values.dtype == np.float16 and rs.values.tolist() == [2050]
    rs = RowSparse(np.array([4, 1, 4]), np.array([1.0, 2.0, 3.0]), (6,)).coalesce()
    assert rs.indices.tolist() == [1, 4] and rs.values.tolist() == [2.0, 4.0]


def test_empty():
    rs = RowSparse(np.zeros(0, np.int64), np.zeros((0, 3), bfloat16), (7, 3))
    assert rs.nnz == 0 and rs.to_dense().shape == (7, 3) and not rs.to_dense().any()
    assert rs.coalesce().nnz == 0


@pytest.mark.parametrize("indices, values, shape, match", [
    (np.zeros((2, 1), np.int64), np.zeros((2, 3)), (4, 3), "indices: expecting a 1-D integer"),
    (np.zeros(2, np.float32), np.zeros((2, 3)), (4, 3), "indices: expecting a 1-D integer"),
    (np.array([0, -1]), np.zeros((2, 3)), (4, 3), r"rows in \[0, 4\), got -1"),
    (np.array([0, 4]), np.zeros((2, 3)), (4, 3), r"rows in \[0, 4\), got 4"),
    (np.array([0, 1]), np.zeros((2, 2)), (4, 3), r"values: expecting shape \(2, 3\)"),
    (np.array([0, 1]), np.zeros((3, 3)), (4, 3), r"values: expecting shape \(2, 3\)"),
    (np.array([0, 1]), np.zeros((2, 3), np.int32), (4, 3), "values: expecting a floating"),
    (np.array([0]), np.zeros((1,)), (), "dense_shape"),
])
def test_validation(indices, values, shape, match):
    with pytest.raises(ValueError, match=match):
        RowSparse(indices, values, shape)


def test_density_rule():
    f32 = np.dtype(np.float32)
    # 30522 x 768 embedding: a few hundred rows per rank gather, most of the table does not
    assert gather_is_cheaper(2 * 300, (30522, 768), f32, 2)
    assert not gather_is_cheaper(2 * 30000, (30522, 768), f32, 2)
    # more ranks make gathering relatively dearer
    assert gather_is_cheaper(16, (10, 4), f32, 2) is False
    assert gather_is_cheaper(4, (10, 4), f32, 2)

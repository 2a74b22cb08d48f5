import numpy as np
import pytest

from mpigrad._base.dtypes import bfloat16
from mpigrad._engine.plan import (DEFAULT_BUCKET_BYTES, DENSE, SKIP, SPARSE, GradSpec, make_plan)

F32 = np.dtype(np.float32)


def dense(n, dtype=F32):
    return GradSpec(DENSE, (n,), np.dtype(dtype))


def groups_of(plan):
    return [b.indices for b in plan.buckets]


def test_split_indices_give_k_plus_one_groups():
    specs = [dense(4)] * 6
    plan = make_plan(specs, split_indices=[2, 5])
    assert groups_of(plan) == [(0, 1), (2, 3, 4), (5,)]
    assert [b.group for b in plan.buckets] == [0, 1, 2]


def test_single_gradient_groups():
    plan = make_plan([dense(3)] * 4, split_indices=[1, 2, 3])
    assert groups_of(plan) == [(0,), (1,), (2,), (3,)]


@pytest.mark.parametrize("bad", [[0], [4], [5], [-1], [2, 2], [3, 1], [1.5], ["1"],
                                 [True], 3])
def test_bad_split_indices_raise_value_error(bad):
    with pytest.raises(ValueError, match="split_indices"):
        make_plan([dense(1)] * 4, split_indices=bad)


def test_one_bucket_per_wire_dtype_within_a_group():
    specs = [dense(2, np.float16), dense(2, np.float64), dense(2, bfloat16),
             dense(2, np.float32), dense(2, np.complex64)]
    plan = make_plan(specs, split_indices=[4])
    assert [(b.indices, b.dtype) for b in plan.buckets] == [
        ((0, 2, 3), F32), ((1,), np.dtype(np.float64)), ((4,), np.dtype(np.complex64))]
    assert plan.buckets[0].nbytes == 6 * 4          # half upcast on the wire


def test_cap_fills_buckets_in_order_and_isolates_big_gradients():
    plan = make_plan([dense(10), dense(10), dense(100), dense(5)], bucket_bytes=80)
    assert groups_of(plan) == [(0, 1), (2,), (3,)]
    assert all(b.nbytes <= 80 or len(b.indices) == 1 for b in plan.buckets)


def test_tiny_cap_gives_one_bucket_per_gradient():
    plan = make_plan([dense(3)] * 5, bucket_bytes=1)
    assert groups_of(plan) == [(i,) for i in range(5)]


def test_default_cap_applies_without_split_indices():
    n = DEFAULT_BUCKET_BYTES // 4
    plan = make_plan([dense(n // 2)] * 5)
    assert groups_of(plan) == [(0, 1), (2, 3), (4,)]


def test_split_groups_are_uncapped_by_default():
    n = DEFAULT_BUCKET_BYTES // 4
    plan = make_plan([dense(n)] * 4, split_indices=[2])
    assert groups_of(plan) == [(0, 1), (2, 3)]


def test_offsets_and_shapes():
    specs = [GradSpec(DENSE, (2, 3), F32), GradSpec(DENSE, (), F32),
             GradSpec(DENSE, (0, 4), F32), GradSpec(DENSE, (5,), F32)]
    (bucket,) = make_plan(specs).buckets
    assert list(bucket.slices()) == [(0, 0, 6, (2, 3)), (1, 6, 7, ()), (2, 7, 7, (0, 4)),
                                     (3, 7, 12, (5,))]
    assert bucket.size == 12 and bucket.nbytes == 48


def test_skipped_and_sparse_stay_out_of_buckets():
    specs = [dense(2), GradSpec(SKIP, (), None), GradSpec(SPARSE, (10, 2), F32),
             GradSpec(SPARSE, (4, 4), np.dtype(np.float16)), GradSpec(SPARSE, (3,), np.float64),
             dense(2)]
    plan = make_plan(specs)
    assert groups_of(plan) == [(0, 5)]
    assert plan.skipped == (1,)
    assert [(g.indices, g.dtype) for g in plan.sparse] == [((2, 3), F32),
                                                           ((4,), np.dtype(np.float64))]


def test_plan_is_immutable():
    plan = make_plan([dense(2)])
    with pytest.raises(AttributeError):
        plan.buckets = ()

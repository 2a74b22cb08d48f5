"""_collective/ops.py: the one op table and op x dtype check every face uses, under
each face's rules (which ops it offers, bools, integer means, its spelling), and each
op's identity (what a rank without data adds)."""

import numpy as np
import pytest

from mpigrad._base.dtypes import bfloat16
from mpigrad._collective.ops import HOROVOD, METRICS, OPS, TABLE, TORCH, check_op, identity


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32, np.float64,
                                   np.complex64])
def test_every_floating_op_takes_floats_and_no_bitwise_op_does(dtype):
    for op, entry in OPS.items():
        complex_refused = np.dtype(dtype).kind == "c" and not entry.complex
        if entry.floating and not complex_refused:
            assert check_op(op, [dtype], "call", TABLE) is entry
        else:
            with pytest.raises(TypeError, match="call: "):
                check_op(op, [dtype], "call", TABLE)


def test_each_faces_rules_in_its_own_words():
    with pytest.raises(ValueError, match=r"expecting one of the ops hvd.Average, hvd.Sum, "
                                         r"hvd.Min, hvd.Max, hvd.Product, got 'band'"):
        check_op("band", [np.int32], "allreduce", HOROVOD)
    with pytest.raises(TypeError, match="AVG needs floating-point arrays, got int64: use SUM"):
        check_op("mean", [np.int64], "all_reduce", TORCH)
    with pytest.raises(TypeError, match="SUM of bool arrays is not defined here: expecting MAX"):
        check_op("sum", [np.bool_], "all_reduce", TORCH)
    assert check_op("sum", [np.bool_], "allreduce", METRICS) is OPS["sum"]   # counted
    assert check_op("mean", [np.int32], "allreduce", HOROVOD) is OPS["mean"]  # truncated


def test_the_first_dtype_refused_is_named_whatever_comes_after():
    dtypes = [np.float32] * 100 + [np.int8, np.bool_] + [np.float32] * 100
    with pytest.raises(TypeError, match="got int8"):
        check_op("mean", dtypes, "all_reduce", TORCH)


#: every op with every dtype it takes (bitwise ops: no floats)
IDENTITIES = [(op, dtype) for op in ("sum", "max", "min", "prod", "band", "bor", "bxor")
              for dtype in (np.int32, np.uint8, np.bool_, np.float32)
              if OPS[op].floating or np.dtype(dtype).kind != "f"]


@pytest.mark.parametrize("op, dtype", IDENTITIES)
def test_an_identity_leaves_every_value_as_it_is(op, dtype):
    values = np.array([0, 1, 5], dtype=dtype) if dtype != np.bool_ else np.array([True, False])
    apply = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply,
             "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    unit = identity(op, dtype)
    with np.errstate(over="ignore"):
        assert np.array_equal(apply(values, unit).astype(dtype), values)

"""Pytrees of gradients: reduced like the flat list of their leaves (in
flattening order), returned in the same structure, the structure checked across
ranks. Run under mpiexec -n 2 and -n 3."""

import collections

import numpy as np
import pytest

from helpers import assert_bitwise_equal, assert_same_on_all_ranks, expected, pattern
from mpigrad import Reducer, StructureMismatchError

pytestmark = pytest.mark.mpi(min_size=2)

Layer = collections.namedtuple("Layer", "weight bias")


def tree_for(rank, key="decoder"):
    """A nested dict / list / namedtuple; flattening order: dict keys sorted."""
    return {"encoder": [Layer(pattern((4, 3), np.float32, rank, 0),
                              pattern((3,), np.float16, rank, 1)),
                        Layer(pattern((3, 2), np.float64, rank, 2),
                              pattern((2,), np.float32, rank, 3))],
            key: {"scale": pattern((), np.float32, rank, 4)}}


SHAPES = [(4, 3), (3,), (3, 2), (2,), ()]
DTYPES = [np.float32, np.float16, np.float64, np.float32, np.float32]
# "decoder" sorts before "encoder": its leaf comes first
ORDER = [4, 0, 1, 2, 3]


def leaves(tree):
    dec = tree["decoder"]["scale"]
    (l0, l1) = tree["encoder"]
    return [dec, l0.weight, l0.bias, l1.weight, l1.bias]


def check_tree(comm, out, mean=True):
    assert set(out) == {"encoder", "decoder"} and isinstance(out["encoder"][0], Layer)
    got = leaves(out)
    for position, seed in enumerate(ORDER):
        want = expected(SHAPES[seed], DTYPES[seed], comm.size, seed, mean=mean)
        assert_bitwise_equal(got[position], want, f"leaf {position}")
    assert_same_on_all_ranks(comm, got)


@pytest.mark.parametrize("how", ["copy", "inplace", "overlap", "zero-copy"])
def test_nested_tree_reduces_like_its_leaves(comm, how):
    tree = tree_for(comm.rank)
    with Reducer(comm, bucket_bytes=32) as reducer:
        assert reducer.plan(tree).count == 5
        if how == "copy":
            out = reducer.reduce(tree)
        elif how == "inplace":
            out = reducer.reduce(tree, inplace=True)
            assert out["encoder"][0].weight is tree["encoder"][0].weight
        elif how == "overlap":
            handle = reducer.start(tree)
            handle.ready(4, 3)
            out = handle.wait()
        else:
            views = reducer.bucket_views(tree)
            for v, g in zip(leaves(views), leaves(tree)):
                if v is not g:
                    v[...] = g
            out = reducer.reduce(views, inplace=True)
    check_tree(comm, out)


def test_skip_and_split_refer_to_flattening_order(comm):
    tree = tree_for(comm.rank)
    with Reducer(comm, skip=[True, False, False, False, False], split_indices=[2]) as reducer:
        out = reducer.reduce(tree)
        plan = reducer.plan(tree)
    assert out["decoder"]["scale"] is tree["decoder"]["scale"]      # leaf 0: skipped
    assert plan.skipped == (0,) and {b.group for b in plan.buckets} == {0, 1}


def test_jax_dict_comes_back_as_jax_arrays(comm):
    jax = pytest.importorskip("jax")
    params = {"w": jax.numpy.asarray(pattern((3, 2), np.float32, comm.rank, 0)),
              "b": jax.numpy.asarray(pattern((2,), np.float32, comm.rank, 1))}
    with Reducer(comm) as reducer:
        out = reducer.reduce(params)
    assert set(out) == {"w", "b"} and all(isinstance(v, jax.Array) for v in out.values())
    assert_bitwise_equal(np.asarray(out["b"]), expected((2,), np.float32, comm.size, 1))
    assert_bitwise_equal(np.asarray(out["w"]), expected((3, 2), np.float32, comm.size, 0))


def test_a_key_that_differs_across_ranks_is_named(comm):
    if comm.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    last = comm.rank == comm.size - 1
    tree = tree_for(comm.rank, key="head" if last else "decoder")
    with Reducer(comm) as reducer:
        with pytest.raises(StructureMismatchError,
                           match=r"tree structure differs.*'decoder'.*'head'"):
            reducer.reduce(tree)


def test_a_leaf_that_differs_across_ranks_is_named_by_its_path(comm):
    if comm.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    last = comm.rank == comm.size - 1
    tree = tree_for(comm.rank)
    if last:
        tree["encoder"][1] = Layer(tree["encoder"][1].weight, np.zeros(5, np.float32))
    with Reducer(comm) as reducer:
        with pytest.raises(StructureMismatchError,
                           match=r"gradient 4 \(\['encoder'\]\[1\](\.bias|\[1\])\) differs "
                                 r"across ranks.*float32\[2\].*float32\[5\]"):
            reducer.reduce(tree)

"""Serial tests of pytree flattening (optree, or jax.tree_util once jax is imported)."""

import collections

import numpy as np

from mpigrad._base.tree import flatten, structure, unflatten

Pair = collections.namedtuple("Pair", "first second")


def test_flat_numpy_list_is_the_fast_path():
    grads = [np.zeros(2), np.ones(3)]
    leaves, spec = flatten(grads)
    assert leaves is grads and spec is None and structure(spec) == "flat"


def test_nested_tree_round_trip_in_sorted_key_order():
    a, b, c, d = (np.full(1, v) for v in range(4))
    tree = {"z": [a, (b,)], "y": Pair(c, d)}
    leaves, spec = flatten(tree)
    assert [int(x[0]) for x in leaves] == [2, 3, 0, 1]          # "y" before "z"
    rebuilt = unflatten(spec, leaves)
    assert rebuilt["z"][0] is a and rebuilt["z"][1][0] is b and isinstance(rebuilt["y"], Pair)
    assert "'y'" in structure(spec) and "'z'" in structure(spec)


def test_none_and_number_lists_below_the_root_stay_leaves():
    leaves, _ = flatten({"a": None, "b": [1.0, 2.0], "c": np.zeros(1)})
    assert leaves[0] is None and leaves[1] == [1.0, 2.0] and len(leaves) == 3

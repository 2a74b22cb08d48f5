"""Pytrees of gradients: flatten to a list of leaves, and back.

A list or tuple of numpy arrays is the fast path (no flattening). Anything else
is flattened by jax.tree_util when the program has imported jax (so that jax's
registered nodes, flax and optax structures, are understood), else by optree:
dicts by sorted key, lists, tuples and namedtuples in order. None, and a list
or tuple of python numbers below the root, are leaves: they are not arrays,
and the reducer says so (a missing gradient is never dropped silently).
"""

import functools
import numbers
import sys
from typing import Any, List, Tuple

from .array_lists import exactly_numpy

__all__ = ["flatten", "flatten_all", "unflatten", "structure", "leaf_paths"]


def _not_a_gradient_tree(node: Any) -> bool:
    return node is None or (type(node) in (list, tuple) and len(node) > 0 and all(
        isinstance(v, numbers.Number) for v in node))


def flatten(tree: Any) -> Tuple[List[Any], Any]:
    """(leaves, spec): the gradients in flattening order, and what ``unflatten``
    needs to rebuild ``tree`` (None for a flat list or tuple of numpy arrays)."""
    if type(tree) in (list, tuple) and exactly_numpy(tree):
        return tree, None
    def is_leaf(node: Any) -> bool:
        return node is not tree and _not_a_gradient_tree(node)

    jax = sys.modules.get("jax")
    if jax is not None:
        leaves, spec = jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)
    else:
        import optree
        leaves, spec = optree.tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=True)
    if spec is not None and type(tree) in (list, tuple) and len(leaves) == len(tree) and \
            all(a is b for a, b in zip(leaves, tree)):
        return tree, None                  # already flat: a list of other arrays
    return leaves, spec


def flatten_all(tree: Any) -> Tuple[List[Any], Any]:
    """(leaves, spec) of any pytree, its root included: None and every
    non-container object are leaves (for broadcast)."""
    jax = sys.modules.get("jax")
    if jax is not None:
        leaves, spec = jax.tree_util.tree_flatten(tree, is_leaf=lambda node: node is None)
        return leaves, spec
    import optree
    return optree.tree_flatten(tree, none_is_leaf=True)


def unflatten(spec: Any, leaves: List[Any]) -> Any:
    """``leaves`` in the structure ``spec`` describes (a list when spec is None)."""
    if spec is None:
        return leaves
    return spec.unflatten(leaves)


@functools.lru_cache(maxsize=1024)
def structure(spec: Any) -> str:
    """A string naming the structure (keys included), equal on ranks that
    agree (made once per structure: small calls pay for every microsecond)."""
    return "flat" if spec is None else str(spec)


def leaf_paths(spec: Any) -> Tuple[str, ...]:
    """Each leaf's path in the structure ``spec`` (``['layer1']['w']``, ``[0].bias``),
    for messages; () for a flat list (positions name its leaves)."""
    if spec is None:
        return ()
    placeholders = spec.unflatten(list(range(spec.num_leaves)))
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(spec, jax.tree_util.PyTreeDef):
        pairs, _ = jax.tree_util.tree_flatten_with_path(
            placeholders, is_leaf=lambda node: isinstance(node, int))
        return tuple(jax.tree_util.keystr(path) for path, _ in pairs)
    import optree
    paths = optree.tree_paths(placeholders, none_is_leaf=True)
    return tuple("".join(f"[{key!r}]" for key in path) for path in paths)

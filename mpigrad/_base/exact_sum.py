"""ExactSum: micro-batch gradients accumulated exactly on one rank, for a
Reducer(reproducible=True) to reduce (mpigrad._base.exact has the method)."""

from typing import Any, List, Optional, Tuple

import numpy as np

from . import exact
from .arrays import to_host
from .dtypes import check_gradient_dtype
from .row_sparse import RowSparse
from .tree import flatten, structure, unflatten

__all__ = ["ExactSum", "real_values"]


def real_values(host: List[np.ndarray]) -> np.ndarray:
    """The arrays' elements in C order, complex ones as (real, imaginary)
    pairs, in one float64 array (exact: every gradient dtype widens to it)."""
    flat = [exact.reals(np.ascontiguousarray(a)) for a in host]
    return np.concatenate(flat, dtype=np.float64) if flat else np.zeros(0)


class ExactSum:
    """The exact sum of gradient pytrees added one by one (say micro-batches),
    to be reduced by ``Reducer(reproducible=True).reduce(acc)``.

    Every ``add`` must pass the same structure, shapes and dtypes (floating or
    complex, dense). Nothing is rounded: the running sum of each element is
    kept as float64 components whose sum is exact (as many as the element
    needs, usually one or two), so the reducer's result (sum or mean) is the
    correctly rounded sum of every addend of every rank, in whatever grouping
    they were added: 8 micro-batches split 8/1, 4/2, 2/4 or 1/8 across ranks
    give the same bits. An infinity or NaN added makes that element's result
    the float64 sum of the non-finite addends.

    The arrays of the first ``add`` are kept (not copied) as ``like``: the
    results come back in their structure and array kinds.
    """

    __slots__ = ("like", "count", "_spec", "_shapes", "_parts", "_special")

    def __init__(self) -> None:
        #: the gradients first added (their structure, shapes, dtypes, kinds)
        self.like: Any = None
        #: how many times ``add`` was called
        self.count = 0
        self._spec: Any = None
        self._shapes: Optional[List[Tuple[Tuple[int, ...], np.dtype]]] = None
        self._parts = np.zeros((1, 0))
        self._special = np.zeros(0)

    def add(self, grads: Any) -> None:
        """Add ``grads`` (a list, tuple or pytree of numpy, torch, jax or cupy
        arrays) exactly."""
        leaves, spec = flatten(grads)
        host, _ = to_host(list(leaves), inplace=False)
        shapes = [(tuple(a.shape), a.dtype) for a in map(np.asarray, host)]
        for index, (leaf, (shape, dtype)) in enumerate(zip(leaves, shapes)):
            if isinstance(leaf, RowSparse):
                raise TypeError(f"ExactSum.add: grads[{index}] is RowSparse; expecting dense "
                                "arrays (reduce RowSparse gradients with reduce(): their rows "
                                "are gathered, not summed)")
            check_gradient_dtype(dtype, index)
        if self._shapes is None:
            self.like, self._spec, self._shapes = grads, spec, shapes
            self._parts = np.zeros((1, exact.size_of(shapes)))
            self._special = np.zeros(self._parts.shape[1])
        elif structure(spec) != structure(self._spec) or shapes != self._shapes:
            raise ValueError(f"ExactSum.add: expecting gradients like the first added "
                             f"({structure(self._spec)}: {_named(self._shapes)}), got "
                             f"{structure(spec)}: {_named(shapes)}")
        values, special = exact.split_special(real_values([np.asarray(a) for a in host]))
        with np.errstate(invalid="ignore"):          # inf + -inf: nan, as it should
            self._special += special
        self._parts = exact.grow(self._parts, values)
        self.count += 1

    def components(self) -> Tuple[np.ndarray, np.ndarray]:
        """(parts, special): the exact sums as float64 components (components
        x elements, in the order of ``real_values`` of the leaves) and the sum
        of the non-finite addends per element (0 where there were none)."""
        if self._shapes is None:
            raise ValueError("ExactSum: nothing was added; call add(grads) first")
        return self._parts, self._special

    def sums(self) -> Any:
        """This accumulator's own exact sums, rounded once to each gradient's
        dtype (numpy arrays, in the structure of ``like``): local, no
        communication."""
        parts, special = self.components()
        agreed = exact.exponents(parts, special)
        words, _ = exact.layout(agreed)
        outs = [np.empty(shape, dtype) for shape, dtype in self._shapes or ()]
        exact.write_results(outs, exact.to_limbs(parts, agreed, words), agreed, special, 1)
        return unflatten(self._spec, outs)


def _named(shapes: Optional[List[Tuple[Tuple[int, ...], np.dtype]]]) -> str:
    return ", ".join(f"{dtype.name}{list(shape)}" for shape, dtype in shapes or ())

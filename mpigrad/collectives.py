"""mpigrad's functions beside the Reducer: broadcast and allreduce of any
pytree, allgather of python objects, checked across ranks and watched like
every mpigrad collective. Each is a translation onto the engine's one typed
collective (mpigrad._collective): the caller's tree into a Collective, run
by a Group, the result back in the caller's kinds and structure."""

import pickle
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import numpy as np

from ._base.arrays import from_host, to_host
from ._base.settings import UNSET, resolve_timeout
from ._base.description import array_item
from ._base.tree import flatten_all, structure, unflatten
from ._base.validate import rank_of
from ._collective import Collective, Group, Kept, Kind, Request
from ._collective.ops import METRICS, check_op
from ._engine.world import Intracomm

__all__ = ["broadcast", "broadcast_on", "allreduce", "allreduce_on", "allgather_object",
           "allgather_object_on", "broadcast_object", "broadcast_object_on"]

_VALUES = (type(None), bool, int, float, complex, str, bytes, np.generic)
_T = TypeVar("_T")


def _is_value(leaf: Any) -> bool:
    return isinstance(leaf, _VALUES)


def _group(comm: Optional[Intracomm], timeout: Any) -> Tuple[Group, Optional[ValueError]]:
    """(the Group mpigrad's functions share on ``comm``, set to ``timeout``; a
    bad timeout to raise collectively or None)."""
    try:
        return Group.shared(comm, resolve_timeout(timeout)), None
    except ValueError as exc:
        return Group.shared(comm, None), exc


def _translate(error: Optional[Exception], translation: Callable[..., _T],
               *args: Any) -> Tuple[Optional[_T], Request]:
    """(``translation(*args)``, its request), or (None, the local error) where
    it failed or ``error`` was given: the error is raised on every rank by the
    call's agreement."""
    try:
        if error is not None:
            raise error
        translated = translation(*args)
    except Exception as exc:
        return None, exc
    return translated, translated.request  # type: ignore[attr-defined]


def broadcast(tree: Any, root: int = 0, comm: Optional[Intracomm] = None,
              timeout: Any = UNSET) -> Any:
    """Give every rank ``root``'s ``tree`` (the initial parameter sync).

    ``tree`` is a pytree (list, tuple, dict, namedtuple, nested) of arrays
    (numpy, torch, cupy, jax; any numeric or bool dtype) and python values
    (numbers, strings, None). Arrays are overwritten in place where they can
    be (writeable numpy, torch, cupy); jax arrays and read-only arrays are
    replaced by new ones, and python values by root's: use the returned tree.
    The structure, dtypes and shapes are compared across ranks first: a
    difference raises StructureMismatchError on every rank and nothing is
    written. Collective over ``comm`` (default COMM_WORLD, duplicated);
    watched like a Reducer (``timeout`` as in Reducer).
    """
    group, error = _group(comm, timeout)
    return broadcast_on(group, tree, root, error)


class _Broadcast:
    """A broadcast's translation: the tree's leaves, their host arrays, and
    the arrays root's values arrive in (the caller's own where writeable)."""

    def __init__(self, group: Group, tree: Any, root: int) -> None:
        self.root = rank_of("root", root, group.size)
        self.mine = group.rank == self.root
        self.leaves, self.spec = flatten_all(tree)
        arrays = [i for i, leaf in enumerate(self.leaves) if not _is_value(leaf)]
        host, self.kinds = to_host([self.leaves[i] for i in arrays], inplace=False)
        self.hosts: List[Any] = [None] * len(self.leaves)
        for i, h in zip(arrays, host):
            if not isinstance(h, np.ndarray) or h.dtype.kind not in "biufc" and \
                    h.dtype.name != "bfloat16":
                raise TypeError(f"tree leaf {i}: expecting an array of a numeric or bool "
                                f"dtype or a python value, got {type(self.leaves[i]).__name__}")
            self.hosts[i] = h
        kinds = iter(self.kinds or [None] * len(arrays))
        self.into = [None if h is None else self._receiver(h, next(kinds)) for h in self.hosts]
        values = [leaf for leaf, h in zip(self.leaves, self.hosts) if h is None]
        self.request = Collective(
            Kind.BROADCAST, "broadcast", tuple(a for a in self.into if a is not None),
            root=self.root, items=tuple(
                "value" if h is None else f"array {h.dtype.name} {h.dtype.str}{list(h.shape)}"
                for h in self.hosts),
            structure=structure(self.spec), payload=pickle.dumps(values) if self.mine else None,
            noun="leaf")

    def _receiver(self, host: np.ndarray, kind: Any) -> np.ndarray:
        """What ``host`` is sent from (root) or received into: itself where it
        can be, else a contiguous copy or a new array."""
        if self.mine:
            return np.ascontiguousarray(host)
        writeable = host.flags.writeable and (kind is None or kind[0] != "jax")
        return host if writeable and host.flags.c_contiguous else np.empty(host.shape, host.dtype)

    def result(self, payload: Optional[bytes]) -> List[Any]:
        """The leaves with root's values: arrays written in place where possible."""
        values = iter(pickle.loads(payload or pickle.dumps([])))
        out, kinds = [], iter(self.kinds or [])
        for leaf, h, got in zip(self.leaves, self.hosts, self.into):
            if h is None:
                out.append(next(values))
                continue
            kind = next(kinds, None)
            writeable = h.flags.writeable and (kind is None or kind[0] != "jax")
            if writeable and got is not h:
                h[...] = got
            result = h if writeable else got
            out.append(result if kind is None else from_host(
                [result], [leaf], [h], [kind], inplace=writeable)[0])
        return out


def broadcast_on(group: Group, tree: Any, root: int, error: Optional[Exception] = None) -> Any:
    """``broadcast`` over ``group``; ``error``: a local error to raise collectively."""
    translated, request = _translate(error, _Broadcast, group, tree, root)
    payload = group.run(request)
    assert translated is not None             # else run raised
    if translated.mine:
        return tree
    return unflatten(translated.spec, translated.result(payload))


def allgather_object(obj: Any, comm: Optional[Intracomm] = None,
                     timeout: Any = UNSET) -> List[Any]:
    """Every rank's picklable ``obj``, in rank order (say, per-rank counts or
    states). Collective over ``comm`` (default COMM_WORLD, duplicated);
    watched like a Reducer (``timeout`` as in Reducer); an object that cannot
    be pickled raises there and PeerError on the other ranks."""
    group, error = _group(comm, timeout)
    return allgather_object_on(group, obj, error)


def allgather_object_on(group: Group, obj: Any,
                        error: Optional[Exception] = None) -> List[Any]:
    """``allgather_object`` over ``group``; ``error``: a local error to raise
    collectively."""
    request: Request
    try:
        if error is not None:
            raise error
        request = Collective(Kind.ALLGATHER, "allgather_object",
                             payload=_pickled(obj, "allgather_object"))
    except Exception as exc:
        request = exc
    return [pickle.loads(part) for part in group.run(request)]


def broadcast_object(obj: Any, root: int = 0, comm: Optional[Intracomm] = None,
                     timeout: Any = UNSET) -> Any:
    """``root``'s picklable ``obj`` on every rank (the others pass anything,
    None say). Collective over ``comm`` (default COMM_WORLD, duplicated);
    watched like a Reducer (``timeout`` as in Reducer)."""
    group, error = _group(comm, timeout)
    return broadcast_object_on(group, obj, root, error)


def broadcast_object_on(group: Group, obj: Any, root: int,
                        error: Optional[Exception] = None) -> Any:
    """``root``'s picklable ``obj`` on every rank, over ``group``: ``broadcast_on``
    of its pickle (an object that cannot be pickled raises on root and
    PeerError on the others); ``error``: a local error to raise collectively."""
    payload = b""
    if error is None and group.rank == root:
        try:
            payload = _pickled(obj, "broadcast_object")
        except TypeError as exc:
            error = exc
    (data,) = broadcast_on(group, [payload], root, error)
    return obj if group.rank == root else pickle.loads(data)


def _pickled(obj: Any, what: str) -> bytes:
    """``obj`` pickled; TypeError naming ``what`` where it cannot be."""
    try:
        return pickle.dumps(obj)
    except Exception as exc:
        raise TypeError(f"{what}: expecting a picklable object, got {type(obj).__name__} "
                        f"({exc})") from None


_NUMBERS = (bool, int, float)
_SCALARS = (*_NUMBERS, np.generic)


def allreduce(value: Any, op: str = "mean", comm: Optional[Intracomm] = None,
              timeout: Any = UNSET) -> Any:
    """Reduce a metric over the ranks: ``op`` is "sum", "mean", "max" or "min".

    ``value`` is a python number, a numpy scalar or array, a torch tensor, a
    jax array, or a pytree of them; the same kind comes back (a python float
    for a python number; integers averaged give floats). For an accuracy over
    unequal shards, sum the correct and the seen counts, then divide. Checked
    across ranks (structure, dtypes, shapes, op) and watched, like a Reducer.
    """
    group, error = _group(comm, timeout)
    return allreduce_on(group, value, op, error)


class _Allreduce:
    """A metric's translation: its leaves and host arrays, and the arrays the
    results arrive in (new ones: the caller's stay as they are; float64 for
    integers averaged)."""

    def __init__(self, value: Any, op: str) -> None:
        check_op(op, (), "allreduce", METRICS)
        self.op = op
        self.leaves, self.spec = flatten_all(value)
        arrays = [_sent(leaf, op) if isinstance(leaf, _SCALARS) else leaf
                  for leaf in self.leaves]
        host, self.kinds = to_host(arrays, inplace=False)
        self.host: List[np.ndarray] = []
        for i, h in enumerate(host):
            h = np.asarray(h)
            if h.dtype.kind not in "biufc" and h.dtype.name != "bfloat16":
                raise TypeError(f"value leaf {i}: expecting a number or a numeric array, "
                                f"got {type(self.leaves[i]).__name__}")
            self.host.append(h)
        check_op(op, {h.dtype for h in self.host}, "allreduce", METRICS)
        averaged = op == "mean" and any(h.dtype.kind in "iub" for h in self.host)
        # in place on copies (a float sum may be the engine's), or into float64 where
        # integers are averaged
        self.sends = tuple(np.array(h, order="C") for h in self.host)
        self.outs = tuple(np.empty(h.shape, np.float64 if h.dtype.kind in "iub" else h.dtype)
                          for h in self.host) if averaged else self.sends
        self.request = Collective(Kind.ALLREDUCE, "allreduce", self.sends,
                                  self.outs if averaged else (), op=op,
                                  items=tuple(array_item(h.dtype, h.shape) for h in self.host),
                                  structure=structure(self.spec), noun="leaf")

    def result(self) -> Any:
        outs = [_returned(leaf, self.op, out) for leaf, out in zip(self.leaves, self.outs)]
        if self.kinds is not None:
            outs = from_host(outs, self.leaves, self.host, self.kinds, inplace=False)
        return unflatten(self.spec, outs)


def allreduce_on(group: Group, value: Any, op: str, error: Optional[Exception] = None) -> Any:
    """``allreduce`` over ``group``; ``error``: a local error to raise collectively."""
    key = None
    if error is None and (type(value) in _ONE_VALUE or isinstance(value, np.generic)):
        array = type(value) is np.ndarray
        sent = value if array else _sent(value, op)
        key = (type(value), sent.dtype, sent.shape, op)
        known = _KNOWN.get(key)
        if known is not None:
            send = np.array(value, order="C") if array else sent      # (a copy)
            group.run(Kept(known, (send,)))
            return send if array else _returned(value, op, send)
    translated, request = _translate(error, _Allreduce, value, op)
    group.run(request)
    assert translated is not None             # else run raised
    if key is not None and translated.outs is translated.sends:
        if len(_KNOWN) >= _KEPT_KNOWN:
            _KNOWN.clear()
        _KNOWN[key] = translated.request.replaced(sends=())      # (it holds no array)
    return translated.result()


#: the values whose calls are translated once per (type, the dtype and shape they
#: are sent as, op): a number, one numpy array, a numpy scalar (a metric every step);
#: their requests, kept (a value that translates into another dtype, a python int past
#: int64 say, is translated as a first call)
_ONE_VALUE = (np.ndarray, float, int)
_KNOWN: Dict[Tuple[Any, ...], Collective] = {}
_KEPT_KNOWN = 1024


def _sent(scalar: Any, op: str) -> np.ndarray:
    """A python number or a numpy scalar as the array it is sent as (a number
    averaged: a float)."""
    return np.asarray(float(scalar) if op == "mean" and isinstance(scalar, _NUMBERS)
                      else scalar)


def _returned(leaf: Any, op: str, result: np.ndarray) -> Any:
    """A leaf's reduced ``result`` in the leaf's kind: a python number for a number (a
    float where averaged), a numpy scalar for one, else the array."""
    if isinstance(leaf, _NUMBERS):
        return float(result) if op == "mean" else type(leaf)(result.item())
    if isinstance(leaf, np.generic):
        return result[()]
    return result

"""mpigrad's functions beside the Reducer: broadcast and allreduce of any
pytree, allgather of python objects, checked across ranks and watched like
every mpigrad collective."""

import pickle
from typing import Any, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ._engine.collective import Communicator, Description, checked
from ._base.arrays import from_host, to_host
from ._base.dtypes import wire_dtype
from ._base.settings import UNSET, resolve_timeout
from ._engine.settle import mean_factor, settle
from ._base.tree import flatten_all, structure, unflatten
from ._base.validate import one_of, rank_of

__all__ = ["broadcast", "broadcast_on", "allreduce", "allreduce_on", "allgather_object",
           "allgather_object_on", "broadcast_object", "broadcast_object_on"]

_VALUES = (type(None), bool, int, float, complex, str, bytes, np.generic)


def _is_value(leaf: Any) -> bool:
    return isinstance(leaf, _VALUES)


def _describe(hosts: List[Any], spec: Any, root: int) -> Description:
    """What every rank must agree on: the root, the structure, each array's
    dtype and shape, which leaves are python values."""
    items = tuple("value" if h is None else f"array {h.dtype.name} {h.dtype.str}{list(h.shape)}"
                  for h in hosts)
    return Description("broadcast", (("root", root),), items, structure(spec), noun="leaf")


def _helper(comm: Optional[MPI.Intracomm],
            timeout: Any) -> Tuple[Communicator, Optional[ValueError]]:
    """(the shared Communicator of ``comm`` set to ``timeout``, a bad timeout
    to raise collectively or None)."""
    try:
        return Communicator.helper(comm, resolve_timeout(timeout)), None
    except ValueError as exc:
        return Communicator.helper(comm, None), exc


def broadcast(tree: Any, root: int = 0, comm: Optional[MPI.Intracomm] = None,
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
    helper, error = _helper(comm, timeout)
    with helper.call():
        return broadcast_on(helper, tree, root, error)


def broadcast_on(helper: Communicator, tree: Any, root: int,
                 error: Optional[Exception] = None) -> Any:
    """``broadcast`` over the Communicator ``helper``, inside a call of it;
    ``error``: a local error to raise collectively."""
    with checked(helper) as call:
        if error is not None:
            raise error
        root = rank_of("root", root, helper.size)
        leaves, spec = flatten_all(tree)
        arrays = [i for i, leaf in enumerate(leaves) if not _is_value(leaf)]
        host, kinds = to_host([leaves[i] for i in arrays], inplace=False)
        hosts: List[Any] = [None] * len(leaves)
        for i, h in zip(arrays, host):
            if not isinstance(h, np.ndarray) or h.dtype.kind not in "biufc" and \
                    h.dtype.name != "bfloat16":
                raise TypeError(f"tree leaf {i}: expecting an array of a numeric or bool "
                                f"dtype or a python value, got {type(leaves[i]).__name__}")
            hosts[i] = h
        payload = b""
        if helper.rank == root:
            payload = pickle.dumps([leaf for leaf, h in zip(leaves, hosts) if h is None])
        call.propose(_describe(hosts, spec, root), extra=len(payload))
    sizes = [0 if h is None else h.nbytes for h in hosts]
    buf = np.empty(sum(sizes) + call.extra, np.uint8)
    if helper.rank == root:
        offset = 0
        for h, n in zip(hosts, sizes):
            if n:
                buf[offset:offset + n] = np.ascontiguousarray(h).reshape(-1).view(np.uint8)
            offset += n
        buf[offset:] = np.frombuffer(payload, np.uint8)
    helper.bcast_bytes(buf, root, "Bcast of a broadcast tree")
    if helper.rank == root:
        return tree
    return unflatten(spec, _unpack(buf, leaves, hosts, sizes, kinds))


def _unpack(buf: np.ndarray, leaves: List[Any], hosts: List[Any], sizes: List[int],
            kinds: Optional[List[Any]]) -> List[Any]:
    """The leaves with root's values: arrays written in place where possible."""
    out, offset = list(leaves), 0
    array_index = 0
    for i, (h, n) in enumerate(zip(hosts, sizes)):
        if h is None:
            continue
        received = buf[offset:offset + n].view(h.dtype).reshape(h.shape)
        offset += n
        kind = kinds[array_index] if kinds is not None else None
        array_index += 1
        writeable = h.flags.writeable and (kind is None or kind[0] != "jax")
        if writeable:
            h[...] = received
        result = h if writeable else received.copy()
        out[i] = result if kind is None else from_host(
            [result], [leaves[i]], [h], [kind], inplace=writeable)[0]
    values = iter(pickle.loads(buf[offset:].tobytes()))
    return [next(values) if h is None else o for o, h in zip(out, hosts)]


def allgather_object(obj: Any, comm: Optional[MPI.Intracomm] = None,
                     timeout: Any = UNSET) -> List[Any]:
    """Every rank's picklable ``obj``, in rank order (say, per-rank counts or
    states). Collective over ``comm`` (default COMM_WORLD, duplicated);
    watched like a Reducer (``timeout`` as in Reducer); an object that cannot
    be pickled raises there and PeerError on the other ranks."""
    helper, error = _helper(comm, timeout)
    with helper.call():
        return allgather_object_on(helper, obj, error)


def allgather_object_on(helper: Communicator, obj: Any,
                        error: Optional[Exception] = None) -> List[Any]:
    """``allgather_object`` over the Communicator ``helper``, inside a call
    of it; ``error``: a local error to raise collectively."""
    with checked(helper) as call:
        if error is not None:
            raise error
        data = _pickled(obj, "allgather_object")
        call.propose(Description("allgather_object"))
    return [pickle.loads(part) for part in helper.allgather_objects(data, "objects")]


def broadcast_object(obj: Any, root: int = 0, comm: Optional[MPI.Intracomm] = None,
                     timeout: Any = UNSET) -> Any:
    """``root``'s picklable ``obj`` on every rank (the others pass anything,
    None say). Collective over ``comm`` (default COMM_WORLD, duplicated);
    watched like a Reducer (``timeout`` as in Reducer)."""
    helper, error = _helper(comm, timeout)
    with helper.call():
        return broadcast_object_on(helper, obj, root, error)


def broadcast_object_on(helper: Communicator, obj: Any, root: int,
                        error: Optional[Exception] = None) -> Any:
    """``root``'s picklable ``obj`` on every rank, over the Communicator
    ``helper``, inside a call of it: ``broadcast_on`` of its pickle (an object
    that cannot be pickled raises on root and PeerError on the others);
    ``error``: a local error to raise collectively."""
    payload = b""
    if error is None and helper.rank == root:
        try:
            payload = _pickled(obj, "broadcast_object")
        except TypeError as exc:
            error = exc
    (data,) = broadcast_on(helper, [payload], root, error)
    return obj if helper.rank == root else pickle.loads(data)


def _pickled(obj: Any, what: str) -> bytes:
    """``obj`` pickled; TypeError naming ``what`` where it cannot be."""
    try:
        return pickle.dumps(obj)
    except Exception as exc:
        raise TypeError(f"{what}: expecting a picklable object, got {type(obj).__name__} "
                        f"({exc})") from None


_OPS = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}
_NUMBERS = (bool, int, float)


def allreduce(value: Any, op: str = "mean", comm: Optional[MPI.Intracomm] = None,
              timeout: Any = UNSET) -> Any:
    """Reduce a metric over the ranks: ``op`` is "sum", "mean", "max" or "min".

    ``value`` is a python number, a numpy scalar or array, a torch tensor, a
    jax array, or a pytree of them; the same kind comes back (a python float
    for a python number; integers averaged give floats). For an accuracy over
    unequal shards, sum the correct and the seen counts, then divide. Checked
    across ranks (structure, dtypes, shapes, op) and watched, like a Reducer.
    """
    helper, error = _helper(comm, timeout)
    with helper.call():
        return allreduce_on(helper, value, op, error)


def allreduce_on(helper: Communicator, value: Any, op: str,
                 error: Optional[Exception] = None) -> Any:
    """``allreduce`` over the Communicator ``helper``, inside a call of it;
    ``error``: a local error to raise collectively."""
    with checked(helper) as call:
        if error is not None:
            raise error
        one_of("op", op, _OPS)
        leaves, spec = flatten_all(value)
        numbers = [isinstance(leaf, _NUMBERS) for leaf in leaves]
        arrays = [np.asarray(float(leaf) if op == "mean" else leaf) if n else leaf
                  for leaf, n in zip(leaves, numbers)]
        host, kinds = to_host(arrays, inplace=False)
        wires = []
        for i, h in enumerate(host):
            h = np.asarray(h)
            if h.dtype.kind not in "biufc" and h.dtype.name != "bfloat16":
                raise TypeError(f"value leaf {i}: expecting a number or a numeric array, "
                                f"got {type(leaves[i]).__name__}")
            if h.dtype.kind == "c" and op in ("max", "min"):
                raise TypeError(f"value leaf {i}: {op} of complex values is not defined")
            host[i] = h
            wires.append(_metric_wire(h.dtype, op))
        call.propose(Description("allreduce", (("op", op),),
                                 tuple(f"{h.dtype.name}{list(h.shape)}" for h in host),
                                 structure(spec), noun="leaf"))
    outs = list(host)
    for wire in dict.fromkeys(wires):        # one message per wire dtype
        members = [i for i, w in enumerate(wires) if w == wire]
        flat = np.concatenate([host[i].astype(wire).reshape(-1) for i in members])
        helper.allreduce(flat, _OPS[op], f"Allreduce of metrics ({wire.name})")
        if op == "mean":                     # integers averaged give float64
            flat = flat.astype(np.float64) if wire.kind in "iub" else flat
            settle(flat, mean_factor(flat.dtype, helper.size))
        offset = 0
        for i in members:
            n = host[i].size
            part = flat[offset:offset + n].reshape(host[i].shape)
            offset += n
            dtype = part.dtype if op == "mean" and wire.kind in "iub" else host[i].dtype
            outs[i] = part.astype(dtype)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _NUMBERS):
            outs[i] = float(outs[i]) if op == "mean" else type(leaf)(outs[i].item())
        elif isinstance(leaf, np.generic):
            outs[i] = outs[i][()]
    if kinds is not None:
        outs = from_host(outs, leaves, host, kinds, inplace=False)
    return unflatten(spec, outs)


def _metric_wire(dtype: np.dtype, op: str) -> np.dtype:
    """The dtype a metric travels in: half precision as float32 (MPI has no
    half types), bools as int64 for sums and means."""
    if dtype.kind == "b":         # MPI's MAX and MIN take no bools: as bytes
        return np.dtype(np.int64) if op in ("sum", "mean") else np.dtype(np.uint8)
    if dtype.kind in "iu":
        return dtype
    return wire_dtype(dtype)

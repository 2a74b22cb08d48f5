"""ALLGATHER and GATHER: every rank's payload (any sizes: their sizes
gathered first, then an ``Allgatherv``), every rank's rows of its arrays
(the one row gather, mpigrad._engine.sparse.gather_rows: their counts
gathered first, then one ``Allgatherv`` of all their bytes), or every
rank's array (the same size on each) in one ``Allgather`` (``Gather``) of
its bytes, straight into the output where it is one array of them all (in
place where the input is this rank's part of it, as FSDP2's all-gather
hands it)."""

from typing import Any, List, Optional, Tuple

import numpy as np

from .._comm.checked import Pending
from .._comm.communicator import Communicator
from .._base.address import address
from .._base.dtypes import wire_dtype
from .._base.huge_pages import prefer_huge_faults
from .._engine.sparse import start_gather_rows
from .memory import as_bytes, unpack
from .reduction import settled
from .spec import Carriage, Collective, Kind

__all__ = ["check", "extra", "carriage", "start"]


def check(spec: Collective, comm: Communicator) -> None:
    """An array's outputs hold one input per rank (where this rank receives);
    a row gather's arrays have as many rows each."""
    if spec.payload is not None:
        return
    if not spec.recvs and spec.kind == Kind.ALLGATHER:
        if any(a.ndim == 0 for a in spec.sends):
            raise ValueError(f"{spec.name}: expecting arrays of at least one dimension, got "
                             "a scalar")
        if len({a.shape[0] for a in spec.sends}) > 1:
            raise ValueError(f"{spec.name}: expecting arrays of as many rows each, got "
                             f"{[a.shape[0] for a in spec.sends]}")
        return
    size = spec.sends[0].nbytes
    receives = spec.kind == Kind.ALLGATHER or comm.rank == spec.root
    total = sum(a.nbytes for a in spec.recvs)
    if receives and total != size * comm.size:
        raise ValueError(f"{spec.name}: expecting outputs of {comm.size} x the input's "
                         f"{size} bytes, got {total}")


def extra(spec: Collective) -> int:
    """Nothing rides on the agreement."""
    return 0


def carriage(spec: Collective, comm: Communicator, capacity: int) -> Optional[Carriage]:
    """Nothing is carried in the agreement: the data moves after it."""
    return None


def start(spec: Collective, comm: Communicator, extra: int) -> Pending:
    """Start the gather; its Pending gives every rank's payload (a payload
    gather) or None (arrays: written into the outputs)."""
    what = f"{spec.kind.value} of {spec.name}"
    if spec.payload is not None:
        mine = np.frombuffer(spec.payload, np.uint8)
        sizes = comm.allgather_counts([mine.size], f"Allgather of the sizes of {what}")[:, 0]
        data = np.empty(int(sizes.sum()), np.uint8)
        started = [comm.start_allgatherv(mine, sizes, data, what)] if data.size else []
        bounds = np.concatenate([[0], np.cumsum(sizes)])

        def payloads() -> List[bytes]:
            return [data[a:b].tobytes() for a, b in zip(bounds[:-1], bounds[1:])]
        return Pending(comm, started, payloads)
    if not spec.recvs and spec.kind == Kind.ALLGATHER:
        return _gather_rows(spec, comm, what)
    send = as_bytes(spec.sends[0])
    receives = spec.kind == Kind.ALLGATHER or comm.rank == spec.root
    recvs = [as_bytes(a) for a in spec.recvs] if receives else []
    whole = len(recvs) == 1
    recv: Optional[np.ndarray] = (recvs[0] if whole else np.empty(send.size * comm.size,
                                                                  np.uint8)) if receives else None
    if spec.kind == Kind.ALLGATHER:
        assert recv is not None
        prefer_huge_faults(address(recv), recv.nbytes)        # FSDP2's: new each step
        in_place = _is_own_part(send, recv, comm.rank)
        if not in_place and np.shares_memory(send, recv):     # MPI reads it as it writes
            send = send.copy()
        started = [comm.start_allgather_bytes(None if in_place else send, recv, what)]
    else:
        assert spec.root is not None
        started = [comm.start_gather_bytes(send, recv, spec.root, what)]

    def finish() -> Any:
        if receives and not whole:
            assert recv is not None
            unpack(recv, recvs)
        return None
    return Pending(comm, started, finish)


def _gather_rows(spec: Collective, comm: Communicator, what: str) -> Pending:
    """Every rank's rows of each of ``spec``'s sends (as bytes: one
    Allgatherv whatever their dtypes, started once the row counts are
    gathered; with op "mean", the floating-point ones averaged over the
    ranks: sparse values), and every rank's row count: what a row gather's
    Pending gives."""
    rows = spec.sends[0].shape[0] if spec.sends else 0
    counts = comm.allgather_counts([rows] * len(spec.sends), f"Allgather of the rows of {what}")
    tables = [np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(
        rows, a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))) for a in spec.sends]
    started, gathered = start_gather_rows(comm, tables, counts, [t.shape[1] for t in tables],
                                          np.dtype(np.uint8))

    def finish() -> Tuple[List[np.ndarray], List[int]]:
        arrays = [g.view(a.dtype).reshape(len(g), *a.shape[1:])
                  for g, a in zip(gathered(), spec.sends)]
        if spec.op == "mean":
            for array in arrays:
                if array.dtype.kind in "fc" or array.dtype.name == "bfloat16":
                    settled(array.astype(wire_dtype(array.dtype)).reshape(-1), [array], spec,
                            comm.size)
        return arrays, [int(c) for c in counts[:, 0]] if spec.sends else [0] * comm.size
    return Pending(comm, [] if started is None else [started], finish)


def _is_own_part(send: np.ndarray, recv: np.ndarray, rank: int) -> bool:
    """Whether ``send`` is exactly this rank's part of ``recv`` (MPI's in place)."""
    if not np.shares_memory(send, recv):
        return False
    offset: int = send.__array_interface__["data"][0] - recv.__array_interface__["data"][0]
    return offset == rank * send.size

"""ALLTOALL and SCATTER: each rank's parts to every rank. ALLTOALL checks
the message sizes first (every rank receives from each what that rank
sends it: one Allgather of every rank's counts, a difference raised on
every rank), then one ``Alltoallv`` of the bytes; SCATTER is root's parts
(one per rank, the same size) in one ``Scatter``."""

from typing import Any, Optional, Sequence

import numpy as np

from .._base.errors import StructureMismatchError
from .._comm.checked import Pending
from .._comm.communicator import Communicator
from .memory import as_bytes, unpack
from .spec import Carriage, Collective, Kind

__all__ = ["check", "extra", "carriage", "start"]


def check(spec: Collective, comm: Communicator) -> None:
    """Nothing beyond the agreement (the sizes are compared once agreed)."""


def extra(spec: Collective) -> int:
    """Nothing rides on the agreement."""
    return 0


def carriage(spec: Collective, comm: Communicator, capacity: int) -> Optional[Carriage]:
    """Nothing is carried in the agreement: the data moves after it."""
    return None


def start(spec: Collective, comm: Communicator, extra: int) -> Pending:
    """Start the exchange (ALLTOALL: after the sizes' check); its Pending
    writes what arrived into the outputs."""
    what = f"{spec.kind.value} of {spec.name}"
    if spec.kind == Kind.SCATTER:
        assert spec.root is not None
        mine = comm.rank == spec.root
        send = np.concatenate([as_bytes(a) for a in spec.sends]) if mine else None
        return Pending(comm, [comm.start_scatter_bytes(send, as_bytes(spec.recvs[0]), spec.root,
                                                       what)], lambda: None)
    sends, recvs = [as_bytes(a) for a in spec.sends], [as_bytes(a) for a in spec.recvs]
    _check_counts(comm, spec.name, [a.size for a in sends], [a.size for a in recvs])
    recv = np.empty(sum(a.size for a in recvs), np.uint8)
    started = [comm.start_alltoallv(np.concatenate(sends) if sends else np.empty(0, np.uint8),
                                    [a.size for a in sends], recv, [a.size for a in recvs],
                                    what)]

    def finish() -> Any:
        unpack(recv, recvs)
        return None
    return Pending(comm, started, finish)


def _check_counts(comm: Communicator, name: str, sends: Sequence[int],
                  recvs: Sequence[int]) -> None:
    """Raise StructureMismatchError on every rank unless each rank receives
    from every rank as many bytes as that rank sends it (one Allgather of
    every rank's counts: each rank finds the same difference)."""
    counts = comm.allgather_counts([*sends, *recvs], f"Allgather of the message sizes of {name}")
    size = comm.size
    for sender in range(size):
        for receiver in range(size):
            sent, expected = counts[sender, receiver], counts[receiver, size + sender]
            if sent != expected:
                raise StructureMismatchError(
                    f"{name}: expecting each rank to receive what its peer sends it, got "
                    f"rank {sender} sending {sent} bytes to rank {receiver}, which expects "
                    f"{expected} bytes from it: make the splits (or the tensors' sizes) "
                    "agree across ranks")

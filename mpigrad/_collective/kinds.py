"""Every collective kind's module, by Kind. Each has the same skeleton:
``check`` (local checks, inside the call's agreement), ``extra`` (what this
rank adds to the agreement: a broadcast's payload size), ``carriage``
(once per signature: how a small call's data rides on the agreement, and
what finishes the call from every rank's; None where the kind carries none) and ``start`` (the
MPI operations started through the watch, and a Pending that finishes the
call); a blocking call is ``start(...).complete()``, a started one its
Pending. A new kind is a module here and a line below."""

from typing import Dict, Optional, Protocol

from .._comm.checked import Pending
from .._comm.communicator import Communicator
from . import allgather, allreduce, alltoall, barrier, broadcast, reduce_scatter
from .spec import Carriage, Collective, Kind

__all__ = ["KindPath", "PATHS"]


class KindPath(Protocol):
    """What the module of a kind offers (see the module docstring)."""

    def check(self, spec: Collective, comm: Communicator) -> None:
        """Raise where this rank cannot take part as ``spec`` asks."""

    def extra(self, spec: Collective) -> int:
        """What this rank adds to the agreement's ``extra`` (the largest of any rank's)."""

    def carriage(self, spec: Collective, comm: Communicator,
                 capacity: int) -> Optional[Carriage]:
        """How calls like ``spec`` carry their data in their agreement, where
        it fits ``capacity`` bytes (None: it moves after the agreement)."""

    def start(self, spec: Collective, comm: Communicator, extra: int) -> Pending:
        """Start ``spec``'s data (agreed; ``extra`` as agreed)."""


PATHS: Dict[Kind, KindPath] = {
    Kind.ALLREDUCE: allreduce, Kind.REDUCE: allreduce,
    Kind.REDUCE_SCATTER: reduce_scatter,
    Kind.BROADCAST: broadcast,
    Kind.ALLGATHER: allgather, Kind.GATHER: allgather,
    Kind.SCATTER: alltoall, Kind.ALLTOALL: alltoall,
    Kind.BARRIER: barrier,
}

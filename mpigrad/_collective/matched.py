"""A Group for an adapter whose calls the ranks agree on by rounds of its own
(the Horovod layer, which matches collectives by name: mpigrad.horovod.matching):
the round's comparison (one Allreduce(MAX), counted as the call's agreement),
the process sets' splits, a shrink after a lost rank, and the pairwise
exchanges of Adasum. The adapter holds MatchingGroups, never a
communicator; its collectives are Collectives, ``check``ed in the round and
started once matched (``Group.start``), through the same routes as every
face's."""

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, List, NamedTuple, Optional, Sequence, cast

import numpy as np
from mpi4py import MPI

from .._base.settings import resolve_timeout
from .._comm.checked import Pending
from .._comm.communicator import Communicator, Started
from .._comm.tally import TALLY
from .group import Group
from .._engine.world import fault_tolerant, split_world, world_rank

__all__ = ["MatchingGroup", "Placement", "Started", "Pending"]

_TAG = 0x4144


class Placement(NamedTuple):
    """Where a rank sits: its rank and size among its node's ranks, and among
    the ranks of its local rank across the nodes."""

    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


class MatchingGroup(Group):
    """A group of ranks for a matching adapter (see the module): its own
    Communicator over ``comm`` (duplicated; the job's timeout; with MPI's fault
    tolerance a lost rank shrinks it), ``owns`` a split made for it."""

    def __init__(self, comm: Any, owns: bool = False) -> None:
        super().__init__(Communicator(comm, timeout=resolve_timeout(),
                                      on_failure="shrink" if fault_tolerant() else "abort"),
                         owned=True, calls=nullcontext)
        self.split_comm = comm if owns else None

    @classmethod
    def of(cls, comm: Optional[Any]) -> "MatchingGroup":
        """The group of ``comm`` (an mpi4py intracommunicator; None: MPI's world)."""
        return cls(MPI.COMM_WORLD if comm is None else comm)

    @classmethod
    def of_world_ranks(cls, ranks: Sequence[int], what: str) -> Optional["MatchingGroup"]:
        """The group of ``ranks`` of MPI's world (collective over the world;
        None on the ranks outside it)."""
        rank = world_rank()
        comm = split_world(0 if rank in ranks else MPI.UNDEFINED, rank, what)
        return None if comm == MPI.COMM_NULL else cls(comm, owns=True)

    def split_group(self, included: bool, what: str) -> Optional["MatchingGroup"]:
        """The group of the ranks that pass ``included`` (collective over this
        group; None on the others), in this group's rank order."""
        comm = self.communicator.split(what, 0 if included else MPI.UNDEFINED, self.rank,
                                       parent=self._own())
        return None if comm == MPI.COMM_NULL else MatchingGroup(comm, owns=True)

    def placement(self) -> Placement:
        """This rank's place among the node's ranks and across the nodes (collective)."""
        node = self.communicator.split("the split into nodes", key=self.rank, shared=True,
                                       parent=self._own())
        cross = self.communicator.split("the split across nodes", node.Get_rank(), self.rank,
                                        parent=self._own())
        try:
            return Placement(node.Get_rank(), node.Get_size(), cross.Get_rank(),
                             cross.Get_size())
        finally:
            node.Free()
            cross.Free()

    def _own(self) -> MPI.Intracomm:
        """The group's own duplicate, which its splits are made of."""
        return cast(MPI.Intracomm, self.communicator.comm)

    def shrink(self) -> List[int]:
        """Carry on over the survivors of a lost rank (collective over them); the lost ranks."""
        return self.communicator.shrink()

    def free(self) -> None:
        super().free()
        if self.split_comm is not None:
            self.split_comm.Free()
            self.split_comm = None

    # -- the adapter's rounds ----------------------------------------------
    def call(self) -> ContextManager[None]:
        """One call of the adapter (a round and what it starts): see Communicator.call."""
        return self.communicator.call()

    def compare(self, flags: np.ndarray, what: str) -> None:
        """The round's agreement: ``flags`` (int64) replaced by their maxima over the ranks."""
        TALLY.agreements += 1
        self.communicator.allreduce(flags, "max", what)

    def allgather_objects(self, obj: Any, what: str) -> List[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        return self.communicator.allgather_objects(obj, what)

    def shares(self, error: BaseException) -> bool:
        """Whether every rank raised ``error`` (or its PeerError) at this point of the call."""
        return self.communicator.shared(error)

    def raise_agreed(self, error: BaseException) -> None:
        """Raise ``error``, which every rank of the call raises at this point."""
        self.communicator.raise_agreed(error)

    def pending(self, started: List[Started], finish: Callable[[], Any]) -> Pending:
        """The agreed collectives ``started``, completed under the watch, then ``finish``."""
        return Pending(self.communicator, started, finish)

    # -- pairwise exchanges (Adasum) ---------------------------------------
    def exchange(self, send: np.ndarray, receive: np.ndarray, partner: int, what: str) -> None:
        """Send the contiguous ``send`` to ``partner`` and receive its part into
        ``receive`` at once, over the group's point-to-point split (made
        collectively first: ``open_point_to_point``)."""
        comm, pairs = self.communicator, self.open_point_to_point()
        started = [comm.start_message("Send", send.reshape(-1).view(np.uint8), partner, _TAG,
                                      what, pairs),
                   comm.start_message("Recv", receive.reshape(-1).view(np.uint8), partner,
                                      _TAG, what, pairs)]
        for s in started:
            comm.wait(s)

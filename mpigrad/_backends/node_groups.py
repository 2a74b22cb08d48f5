"""The node structure of a Reducer's communicator, for the node sums: the
ranks of each node (they can map each other's memory) and, across nodes, the
ranks that hold the same local rank. Collectives on both are waited for
through the Reducer's watch (a peer that leaves raises, a stall aborts)."""

import functools
from typing import Callable, List, Optional

import numpy as np
from mpi4py import MPI

from .._comm.communicator import Communicator
from .flight import Sums
from .wire import compresses

__all__ = ["NodeGroups"]


class NodeGroups:
    """The node and cross-node communicators of a Communicator (collective).

    ``node``: the ranks that share memory with this one (Split_type; with ``node_size``,
    MPIGRAD_NODE_SIZE, that split cut further into every ``node_size`` consecutive world
    ranks, so that a simulated node never spans two hosts); ``cross``: one rank of every
    node, those with this rank's local rank. ``problem`` says why the node
    structure cannot carry the shared-memory path (None if it can): nodes of
    different sizes.
    """

    def __init__(self, communicator: Communicator, node_size: Optional[int] = None) -> None:
        self.communicator = communicator
        rank = communicator.rank
        self.node = communicator.split("the split into nodes", key=rank, shared=True)
        if node_size is not None:
            self.node = communicator.split("the split into simulated nodes",
                                           MPI.COMM_WORLD.Get_rank() // node_size, rank,
                                           within=self.node)
        self.local_rank: int = self.node.Get_rank()
        self.local_size: int = self.node.Get_size()
        self.cross = communicator.split("the split across nodes", self.local_rank, rank)
        self.nodes: int = self.cross.Get_size()
        sizes = np.array([self.local_size, -self.local_size], np.int64)
        communicator.allreduce(sizes, "max", "node size agreement")
        self.problem = None if sizes[0] == -sizes[1] else (
            f"nodes have different numbers of ranks (from {-sizes[1]} to {sizes[0]})")

    @property
    def packing_pays(self) -> bool:
        """Whether summing a packed in-place call in node memory (a copy in,
        the node sum, a copy out) beats the MPI library's own Allreduce: not
        with MPICH, whose shared-memory Allreduce runs near memory-copy speed;
        with Open MPI it does. Plain reduces (which copy out anyway) and
        zero-copy calls gain with both (docs/performance.md, "Node memory")."""
        return "MPICH" not in MPI.Get_library_version()

    def barrier(self, what: str) -> None:
        """Every rank of the node has arrived (watched)."""
        self.communicator.collective("Barrier", (), what, self.node)

    def agree_all(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` holds on every rank of the communicator (watched)."""
        value = np.array([1 if flag else 0], np.int64)
        self.communicator.allreduce(value, "min", what)
        return bool(value[0])

    def reasons(self, mine: Optional[str]) -> str:
        """Every rank's reason (None: none), as "rank r: why; ..." (watched)."""
        reasons = self.communicator.allgather_reports(mine)
        return "; ".join(f"rank {r}: {why}" for r, why in enumerate(reasons) if why)

    def allgather_bytes(self, mine: bytes, width: int, what: str) -> List[bytes]:
        """Every local rank's ``mine`` (bytes of at most ``width``), in local rank order."""
        send = np.zeros(width + 1, np.uint8)
        send[0] = len(mine)
        send[1:1 + len(mine)] = np.frombuffer(mine, np.uint8)
        recv = np.empty((self.local_size, width + 1), np.uint8)
        self.communicator.collective("Allgather", ([send, MPI.BYTE], [recv, MPI.BYTE]), what,
                                     self.node)
        return [bytes(row[1:1 + row[0]]) for row in recv]

    def node_ranks(self) -> List[int]:
        """The local ranks as ranks of the communicator, in local rank order."""
        return list(MPI.Group.Translate_ranks(self.node.Get_group(), list(range(self.local_size)),
                                              self.communicator.comm.Get_group()))

    def allgather_node(self, values: object, what: str) -> np.ndarray:
        """Every local rank's int64 vector ``values`` (of one length on every
        rank), as a (local ranks, len) matrix in local rank order (watched)."""
        send = np.ascontiguousarray(values, np.int64)
        recv = np.empty((self.local_size, send.size), np.int64)
        self.communicator.collective("Allgather", ([send, MPI.INT64_T], [recv, MPI.INT64_T]),
                                     what, self.node)
        return recv

    def sums_across(self, wire: Optional[str], poll: bool = False) -> Sums:
        """Pieces summed over the nodes (among the ranks of this local rank) through
        ``wire``, in flight."""
        return Sums(self.communicator, wire, self.cross, poll)

    def sum_across(self, flat: np.ndarray, what: str, wire: Optional[str],
                   done: Callable[[int, int], None] = lambda lo, hi: None,
                   make: Callable[[int, int], None] = lambda lo, hi: None) -> None:
        """Sum the 1-D ``flat`` over the nodes in place, in pieces of the Reducer's
        chunk_bytes, each made first by ``make(lo, hi)`` (the node sum of that piece) and
        handed to ``done(lo, hi)`` once summed: the node sum of the next piece runs while
        the last one crosses the link (one Iallreduce in flight, or WINDOW pieces of the
        bfloat16 wire), in the same order on every rank (watched)."""
        sums = self.sums_across(wire)
        for lo, hi in sums.cuts(flat):
            make(lo, hi)
            sums.make_room()
            sums.add(flat[lo:hi], what, functools.partial(done, lo, hi))
            sums.progress()
        sums.finish()

    def allreduce_across(self, flat: np.ndarray, what: str, wire: Optional[str]) -> None:
        """Sum the 1-D ``flat`` over the nodes (among the ranks of this local
        rank), in place, in pieces of the Reducer's chunk_bytes (watched)."""
        if self.nodes > 1 and compresses(wire, flat.dtype):
            self.sum_across(flat, what, wire)
        elif self.nodes > 1:
            self.communicator.allreduce_sum(flat, what, self.cross)

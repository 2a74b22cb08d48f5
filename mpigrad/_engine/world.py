"""MPI's world as the faces see it, without holding a communicator: this
process's rank and the world's size, whether a value is a communicator a
user may pass, the world split into groups of ranks, whether the job can
shrink past a lost rank, and an uncaught error ending the whole job."""

from typing import Any

from mpi4py import MPI

from .._comm.communicator import Communicator, install_abort_handler
from .._comm.launch_check import check_launch, launcher_hint
from .._comm.ulfm import ulfm_problem

__all__ = ["Intracomm", "world_rank", "world_size", "is_communicator", "split_world",
           "free_communicator", "this_rank_alone", "threads_supported", "fault_tolerant", "install_abort_handler",
           "check_launch", "launcher_hint"]

#: what a user may pass as a group of ranks (mpi4py's intracommunicator)
Intracomm = MPI.Intracomm


def world_rank() -> int:
    """This process's rank in MPI's world."""
    rank: int = MPI.COMM_WORLD.Get_rank()
    return rank


def world_size() -> int:
    """The number of ranks in MPI's world."""
    size: int = MPI.COMM_WORLD.Get_size()
    return size


def is_communicator(value: Any) -> bool:
    """Whether ``value`` is an mpi4py intracommunicator."""
    return isinstance(value, MPI.Intracomm)


def split_world(color: int, key: int, what: str) -> Intracomm:
    """MPI's world split into the groups of each ``color`` (ordered by ``key``),
    after a watched barrier (collective over the world: a rank that never
    comes is named instead of hanging the others); free it with
    ``free_communicator``."""
    split: Intracomm = Communicator.helper(MPI.COMM_WORLD).split(what, color, key,
                                                                  parent=MPI.COMM_WORLD)
    return split


def free_communicator(comm: Intracomm) -> None:
    """Free a communicator ``split_world`` made."""
    comm.Free()


def this_rank_alone() -> Intracomm:
    """A communicator of this process alone (MPI's COMM_SELF)."""
    return MPI.COMM_SELF


def threads_supported() -> bool:
    """Whether MPI was initialised for calls from any thread (MPI_THREAD_MULTIPLE)."""
    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def fault_tolerant() -> bool:
    """Whether this job can shrink past a lost rank (MPI with ULFM, launched for it)."""
    return ulfm_problem() is None

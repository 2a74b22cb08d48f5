"""Launch and groups without MindSpore's cluster: the ranks are MPI's
(``mpiexec``, ``srun``), with no scheduler, ``msrun`` or ``init()``; a group
is MindSpore's world group name, an mpi4py communicator or a list of ranks."""

import os
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Sequence

from .._engine.world import (Intracomm, free_communicator, is_communicator, split_world,
                             world_rank, world_size)
from ..collectives import allgather_object

__all__ = ["WORLD_GROUPS", "init", "get_rank", "get_group_size", "check_launch",
           "communicator"]

#: MindSpore's names of the world group (Ascend, GPU, CPU): COMM_WORLD here
WORLD_GROUPS = ("hccl_world_group", "nccl_world_group", "mccl_world_group")


def init(backend_name: Optional[str] = None) -> None:
    """The stand-in for ``mindspore.communication.init``: MPI's launcher has
    made the ranks already, so this only checks that MindSpore's own
    communication is not running beside them (``check_launch``).
    ``backend_name`` is accepted and ignored (MPI is the backend)."""
    check_launch()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default the world): ``mindspore.communication.get_rank``
    for MPI's ranks."""
    if _is_rank_list(group):
        return _rank_list(group, world_size()).index(world_rank())
    comm = _named(group)
    return world_rank() if comm is None else int(comm.rank)


def get_group_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (default the world):
    ``mindspore.communication.get_group_size`` for MPI's ranks."""
    if _is_rank_list(group):
        return len(_rank_list(group, world_size()))
    comm = _named(group)
    return world_size() if comm is None else int(comm.size)


def check_launch() -> None:
    """RuntimeError where MindSpore's launcher or communication, not MPI,
    made the processes: ``msrun`` (its MS_WORKER_NUM), or
    ``mindspore.communication.init()`` under it, for another number of
    processes than MPI's world has: each would train alone, unsynchronised."""
    ours = world_size()
    workers = os.environ.get("MS_WORKER_NUM", "")
    if workers.isdigit() and int(workers) != ours:
        theirs = int(workers)
    else:
        from mindspore.communication import GlobalComm, get_group_size as mindspore_size
        theirs = mindspore_size() if GlobalComm.INITED else ours
        if theirs == ours:
            return
    raise RuntimeError(
        f"MindSpore's launcher made {theirs} processes (msrun, or init() under its scheduler), "
        f"but MPI's world has {ours}: mpigrad reduces over MPI's ranks, so these processes "
        f"would not train together; launch with `mpiexec -n {theirs} python train.py` (or "
        "srun), without msrun and mindspore.communication.init() (mpigrad.mindspore.init() "
        "stands in for it)")


@contextmanager
def communicator(group: Any) -> Iterator[Optional[Intracomm]]:
    """The communicator of ``group`` for the block (None: the world; one made
    here, a list's split, is freed after it: a Reducer holds a duplicate of its
    own)."""
    if not _is_rank_list(group):
        yield _named(group)
        return
    comm = _split(group)
    try:
        yield comm
    finally:
        free_communicator(comm)


def _split(group: Sequence[Any]) -> Intracomm:
    """COMM_WORLD split by lists of ranks: every rank of the world takes part,
    each passing the list of its own group (the lists partition the world's
    ranks); a difference raises ValueError on every rank."""
    rank = world_rank()
    mine: Optional[List[int]] = None
    error: Optional[ValueError] = None
    try:
        mine = _rank_list(group, world_size())
        if rank not in mine:
            raise ValueError(f"group: expecting a list of ranks holding this rank "
                             f"({rank}), got {mine}: every rank passes the list of "
                             "its own group")
    except ValueError as exc:
        error = exc
    lists = allgather_object(mine)
    if error is not None:
        raise error
    for other, ranks in enumerate(lists):
        if ranks is None or any(lists[peer] != ranks for peer in ranks):
            raise ValueError(f"group: rank {other}'s list of ranks ({ranks}) is not the same "
                             "on the ranks it holds (or that rank's is wrong): every rank "
                             "passes the list of its own group, the lists a partition of "
                             "the world's ranks")
    assert mine is not None
    return split_world(min(mine), mine.index(rank), "the split into the groups' ranks")


def _is_rank_list(group: Any) -> bool:
    return isinstance(group, (list, tuple, range))


def _rank_list(group: Sequence[Any], size: int) -> List[int]:
    ranks = list(group)
    if (not ranks or any(not isinstance(r, int) or isinstance(r, bool) for r in ranks)
            or len(set(ranks)) != len(ranks) or min(ranks) < 0 or max(ranks) >= size):
        raise ValueError(f"group: expecting distinct ranks in [0, {size}), got {ranks}")
    return ranks


def _named(group: Any) -> Optional[Intracomm]:
    """The communicator a group names: None for the world."""
    if group is None or (isinstance(group, str) and group in WORLD_GROUPS):
        return None
    if is_communicator(group):
        comm: Intracomm = group
        return comm
    if isinstance(group, str):
        raise ValueError(f"group: expecting the world group ({', '.join(WORLD_GROUPS)}), an "
                         f"mpi4py communicator or a list of ranks, got the group name "
                         f"{group!r}: MindSpore's create_group() groups are not MPI's; pass "
                         "the group's ranks as a list")
    raise TypeError(f"group: expecting None, a world group name, an mpi4py communicator or a "
                    f"list of ranks, got {type(group).__name__}")

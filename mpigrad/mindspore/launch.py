"""Launch and groups without MindSpore's cluster: the ranks are MPI's
(``mpiexec``, ``srun``), with no scheduler, ``msrun`` or ``init()``; a group
is MindSpore's world group name, an mpi4py communicator or a list of ranks."""

import os
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Sequence, cast

from mpi4py import MPI

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
        return _rank_list(group, MPI.COMM_WORLD.size).index(MPI.COMM_WORLD.rank)
    return int(_named(group).rank)


def get_group_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (default the world):
    ``mindspore.communication.get_group_size`` for MPI's ranks."""
    if _is_rank_list(group):
        return len(_rank_list(group, MPI.COMM_WORLD.size))
    return int(_named(group).size)


def check_launch() -> None:
    """RuntimeError where MindSpore's launcher or communication, not MPI,
    made the processes: ``msrun`` (its MS_WORKER_NUM), or
    ``mindspore.communication.init()`` under it, for another number of
    processes than MPI's world has: each would train alone, unsynchronised."""
    ours = MPI.COMM_WORLD.size
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
def communicator(group: Any) -> Iterator[MPI.Intracomm]:
    """The communicator of ``group`` for the block (one made here, a list's
    split, is freed after it: a Reducer holds a duplicate of its own)."""
    if not _is_rank_list(group):
        yield _named(group)
        return
    comm = _split(group)
    try:
        yield comm
    finally:
        comm.Free()


def _split(group: Sequence[Any]) -> MPI.Intracomm:
    """COMM_WORLD split by lists of ranks: every rank of the world takes part,
    each passing the list of its own group (the lists partition the world's
    ranks); a difference raises ValueError on every rank."""
    world = MPI.COMM_WORLD
    mine: Optional[List[int]] = None
    error: Optional[ValueError] = None
    try:
        mine = _rank_list(group, world.size)
        if world.rank not in mine:
            raise ValueError(f"group: expecting a list of ranks holding this rank "
                             f"({world.rank}), got {mine}: every rank passes the list of "
                             "its own group")
    except ValueError as exc:
        error = exc
    lists = allgather_object(mine)
    if error is not None:
        raise error
    for rank, ranks in enumerate(lists):
        if ranks is None or any(lists[peer] != ranks for peer in ranks):
            raise ValueError(f"group: rank {rank}'s list of ranks ({ranks}) is not the same "
                             "on the ranks it holds (or that rank's is wrong): every rank "
                             "passes the list of its own group, the lists a partition of "
                             "the world's ranks")
    assert mine is not None
    return cast(MPI.Intracomm, world.Split(min(mine), mine.index(world.rank)))


def _is_rank_list(group: Any) -> bool:
    return isinstance(group, (list, tuple, range))


def _rank_list(group: Sequence[Any], size: int) -> List[int]:
    ranks = list(group)
    if (not ranks or any(not isinstance(r, int) or isinstance(r, bool) for r in ranks)
            or len(set(ranks)) != len(ranks) or min(ranks) < 0 or max(ranks) >= size):
        raise ValueError(f"group: expecting distinct ranks in [0, {size}), got {ranks}")
    return ranks


def _named(group: Any) -> MPI.Intracomm:
    if group is None or (isinstance(group, str) and group in WORLD_GROUPS):
        return MPI.COMM_WORLD
    if isinstance(group, MPI.Intracomm):
        return group
    if isinstance(group, str):
        raise ValueError(f"group: expecting the world group ({', '.join(WORLD_GROUPS)}), an "
                         f"mpi4py communicator or a list of ranks, got the group name "
                         f"{group!r}: MindSpore's create_group() groups are not MPI's; pass "
                         "the group's ranks as a list")
    raise TypeError(f"group: expecting None, a world group name, an mpi4py communicator or a "
                    f"list of ranks, got {type(group).__name__}")

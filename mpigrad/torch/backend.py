"""The torch.distributed backend "mpigrad": ``import mpigrad.torch``, then,
under ``mpiexec`` or ``srun``, ``torch.distributed.init_process_group("mpigrad")``.

Ranks and the world size come from MPI: with no ``MASTER_ADDR`` set, the
``env://`` rendezvous (torch's default) takes them from MPI and gives torch a
store local to the process, so no socket is opened; with ``MASTER_ADDR`` (and
``MASTER_PORT``) set, as a tutorial's lines set them, torch's own TCP store
there, with MPI's ranks. A ``rank`` or ``world_size`` (or ``RANK``,
``WORLD_SIZE``) that disagrees with MPI's raises before any rendezvous,
naming both (and, launched by torchrun, saying to launch with mpiexec). Groups
(``new_group``) are MPI communicators of their ranks. See process_group.py
for what each collective does.
"""

import importlib
import os
from typing import Any, Dict, Iterator, List, Tuple
from urllib.parse import parse_qs, urlencode, urlparse, urlunparse

import torch.distributed as dist

from .._collective import Group
from .._engine.world import check_launch, launcher_hint, world_rank, world_size
from .process_group import MpiProcessGroup, watch_seconds

__all__ = ["NAME", "create", "register"]

#: the backend's name, as init_process_group takes it
NAME = "mpigrad"

_WORLD: List[MpiProcessGroup] = []       # the default group, once made: subgroups split from it
_ENV_RENDEZVOUS: List[Any] = []          # torch's own env:// handler, once routed


def _world_says(rank: int, size: int) -> None:
    """ValueError where torch's rank or world size is not MPI's."""
    if (rank, size) != (world_rank(), world_size()):
        hint = launcher_hint()
        launcher = (f"; this process was {hint}" if hint else
                    f"; the '{NAME}' backend's ranks are MPI's: launch with `mpiexec -n N "
                    "python script.py` (or srun)")
        raise ValueError(
            f"init_process_group('{NAME}'): expecting rank {world_rank()} of world_size "
            f"{world_size()} (MPI's: the launcher's), got rank {rank} of world_size {size}: "
            f"leave rank and world_size (and RANK, WORLD_SIZE) unset, or give MPI's{launcher}")


def create(options: Any, backend_options: Any) -> MpiProcessGroup:
    """The process group torch asks for: the world (the default group) or a
    group of ``options.global_ranks_in_group``, made by those ranks only."""
    timeout = watch_seconds(options.timeout)
    ranks = list(options.global_ranks_in_group)
    live = bool(_WORLD) and not _WORLD[0].group.freed      # not destroyed since
    if not ranks or (ranks == list(range(world_size())) and not live):
        _world_says(options.group_rank, options.group_size)
        group = MpiProcessGroup(Group.over(None, timeout, point_to_point=True, on_stall="raise"),
                                options.group_id)
        _WORLD[:] = [group]
        return group
    if not live:
        raise RuntimeError(f"new_group({ranks}) on the '{NAME}' backend: expecting a group of "
                           f"every rank on '{NAME}' first (init_process_group('{NAME}'), or "
                           f"new_group(backend='{NAME}') of every rank)")
    return _WORLD[0].subgroup(ranks, timeout, options.group_id)


def _from_mpi(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[Tuple[Any, int, int]]:
    """The env:// rendezvous: the ranks and size from MPI (checked against
    any given first: another world's RANK never waits in a rendezvous;
    plain ``python`` is a world of 1). Without MASTER_ADDR a store local to
    the process (nothing of torch's needs a shared one with this backend);
    with it, torch's own handler (a TCP store: gloo groups beside work),
    given MPI's ranks."""
    check_launch()               # a launcher's processes, each a world of 1: refused
    parsed = urlparse(url)
    given = {k: v[0] for k, v in parse_qs(parsed.query).items()}
    query = {k: int(v) for k, v in given.items() if k in ("rank", "world_size")}
    rank = query.get("rank", int(os.environ.get("RANK", world_rank())))
    size = query.get("world_size", int(os.environ.get("WORLD_SIZE", world_size())))
    _world_says(world_rank() if rank == -1 else rank, world_size() if size == -1 else size)
    if os.environ.get("MASTER_ADDR"):
        ranks = urlencode({**given, "rank": world_rank(), "world_size": world_size()})
        with_ranks = urlunparse((parsed.scheme, parsed.netloc, parsed.path, parsed.params,
                                 ranks, parsed.fragment))
        yield from _ENV_RENDEZVOUS[0](with_ranks, timeout=timeout, **kwargs)
        return
    yield dist.HashStore(), world_rank(), world_size()
    raise RuntimeError("the env:// rendezvous from MPI cannot be repeated")


def _route_env_rendezvous() -> None:
    """Send torch's env:// rendezvous through ``_from_mpi``. torch has no
    public way to replace a registered handler, so its table is written here,
    once (and _mpigrad_torch_autoload wraps the handler for its error
    message): the two places mpigrad touches torch's internals."""
    # the module (torch.distributed's attribute of that name is its function)
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    handlers: Dict[str, Any] = rendezvous._rendezvous_handlers
    if not _ENV_RENDEZVOUS and "env" in handlers:
        _ENV_RENDEZVOUS.append(handlers["env"])
        handlers["env"] = _from_mpi


def register() -> None:
    """Register the backend (once; ``import mpigrad.torch`` does) and route
    the env:// rendezvous through MPI (where torch's autoload registered the
    name, its creator calls ``create``)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu"])
    _route_env_rendezvous()


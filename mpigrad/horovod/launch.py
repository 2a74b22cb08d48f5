"""``horovod.run`` for scripts that launch themselves: mpigrad does not
start processes, it runs inside a job that ``mpiexec`` or ``srun`` started."""

import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

from .._engine.world import world_size
from ..collectives import allgather_object

__all__ = ["run"]


def run(func: Callable[..., Any], args: Sequence[Any] = (),
        kwargs: Optional[Dict[str, Any]] = None, np: Optional[int] = None,
        **launcher_options: Any) -> List[Any]:
    """Horovod's ``horovod.run``: ``func(*args, **kwargs)`` on every rank;
    the results in rank order. Horovod starts ``np`` processes here; mpigrad
    runs in the job MPI started, so ``np`` must be its size (None: any).
    The launcher's options (``hosts``, ``use_gloo``, ``use_mpi``, ``verbose``,
    ...) are the launch's, already done: they are accepted and not used."""
    size = world_size()
    if np is not None and np != size:
        script = " ".join(sys.argv) or "your_script.py"
        raise RuntimeError(
            f"horovod.run: expecting np to be this job's size ({size} rank(s)), got np={np}: "
            "mpigrad does not start processes; launch the script under MPI instead, e.g. "
            f"`mpiexec -n {np} python {script}` (leaving out the option that chose "
            "horovod.run, so the script calls its function directly)")
    result = func(*args, **(kwargs or {}))
    return allgather_object(result)

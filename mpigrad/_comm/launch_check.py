"""A launch that cannot be what the user meant: MPI's world holds 1 rank
while a launcher says it started several processes (torchrun, a plain
``srun``, another MPI library's ``mpiexec``), so each process would train
alone on the whole batch, in silence. Refused at the first mpigrad call of
each process (every one of them: each is a world of its own), naming the
launcher and the command that works; ``MPIGRAD_ALONE=1`` allows it, for
processes that are meant to run alone. A plain one-rank run (``python``,
``mpiexec -n 1``, a notebook, one process inside a batch allocation, whose
``SLURM_NTASKS`` says nothing about it) says nothing."""

import os
import sys
from typing import Optional

from mpi4py import MPI

from .._base.errors import LaunchError

__all__ = ["check_launch", "launch_problem", "launcher_hint"]


def _count(name: str) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else 0


def launcher_hint() -> Optional[str]:
    """What the environment says about the launcher that started this
    process, and the command that makes one MPI job of its processes; None
    where no launcher of several processes is seen."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    size = max(_count("WORLD_SIZE"), _count("LOCAL_WORLD_SIZE"))
    if os.environ.get("TORCHELASTIC_RUN_ID") or size > 1:
        n = size if size > 1 else "N"
        return (f"started by torchrun or another torch launcher (WORLD_SIZE={n}); mpigrad's "
                f"ranks are MPI's: launch with `mpiexec -n {n} python script.py` instead")
    slurm = _count("SLURM_STEP_NUM_TASKS")
    if slurm > 1:
        return (f"started by srun as {slurm} tasks without MPI's process management "
                f"(SLURM_STEP_NUM_TASKS={slurm}): launch with `{mpiexec} -n {slurm} python "
                f"script.py` inside the allocation (or `srun --mpi=pmi2 -n {slurm} python "
                "script.py`)")
    library = MPI.Get_library_version().splitlines()[0].strip()
    for name, who in (("OMPI_COMM_WORLD_SIZE", "Open MPI's mpiexec"),
                      ("PMI_SIZE", "an MPICH-style launcher (hydra's mpiexec, or srun's PMI)"),
                      ("PMIX_SIZE", "a PMIx launcher (Open MPI's mpiexec, or srun's PMIx)"),
                      ("MPI_LOCALNRANKS", "MPICH's mpiexec")):
        count = _count(name)
        if count > 1:
            return (f"started by {who} as {count} processes ({name}={count}), while mpi4py "
                    f"uses another MPI library ({library}): launch with the mpiexec of "
                    f"mpi4py's MPI, `{mpiexec} -n {count} python script.py`")
    return None


def launch_problem() -> Optional[str]:
    """Why this process's launch cannot be what was meant (see the module);
    None where it can."""
    if MPI.COMM_WORLD.Get_size() != 1 or os.environ.get("MPIGRAD_ALONE", "") == "1":
        return None
    hint = launcher_hint()
    if hint is None:
        return None
    return (f"MPI's world has 1 rank, but this process was {hint}. As it is, every process "
            "would train alone on its whole batch. Set MPIGRAD_ALONE=1 where each process "
            "is meant to run alone.")


def check_launch() -> None:
    """LaunchError where ``launch_problem`` names one."""
    problem = launch_problem()
    if problem is not None:
        raise LaunchError(problem)

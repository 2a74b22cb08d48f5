"""A launch that cannot be what was meant is refused on every process at its
first mpigrad call, before any gradient moves, naming the launcher and the
command that works; plain one-rank use says nothing. Each face's script runs
as N separate one-rank worlds under a launcher's N-process environment (N = 2,
and 3 for the faces that import no framework: the check is the same
Communicator's), concurrently, as torchrun, a plain srun, or another MPI
library's mpiexec would start them, and once plainly. (Every face at 2 and 3
ranks of one MPI job: the collective tests.)"""

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import outlasting

#: the processes' own limit (_run)
RUN_SECONDS = 300
pytestmark = outlasting(RUN_SECONDS)

SCRIPTS = {
    "numpy": """
        import numpy as np, mpigrad
        reducer = mpigrad.Reducer()
        grads = reducer.reduce([np.ones(4, np.float32)])
        print("moved", grads[0].tolist(), flush=True)
    """,
    "metrics": """
        import mpigrad
        print("moved", mpigrad.allreduce(1.0), flush=True)
    """,
    "torch optimizer": """
        import torch, mpigrad.torch
        model = torch.nn.Linear(2, 1)
        opt = mpigrad.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        print("moved", model.weight.tolist(), flush=True)
    """,
    "torch backend": """
        import torch, torch.distributed as dist, mpigrad.torch
        dist.init_process_group("mpigrad")
        t = torch.ones(2)
        dist.all_reduce(t)
        print("moved", t.tolist(), flush=True)
    """,
    "jax": """
        import jax, jax.numpy as jnp, optax, mpigrad.jax
        tx = optax.chain(mpigrad.jax.mean_gradients(), optax.sgd(0.1))
        step = jax.jit(lambda g, s: tx.update(g, s))
        updates, _ = step([jnp.ones(2)], tx.init([jnp.ones(2)]))
        print("moved", updates[0].tolist(), flush=True)
    """,
    "horovod": """
        import torch, mpigrad.horovod.torch as hvd
        hvd.init()
        print("moved", hvd.allreduce(torch.ones(2)).tolist(), flush=True)
    """,
}
NEEDS = {"torch optimizer": "torch", "torch backend": "torch", "jax": "optax",
         "horovod": "torch"}
#: each face under one launcher's environment (every launcher in turn); {n} processes
LAUNCHERS = {
    "torchrun": ({"WORLD_SIZE": "{n}", "LOCAL_WORLD_SIZE": "{n}", "RANK": "{rank}",
                  "LOCAL_RANK": "{rank}", "TORCHELASTIC_RUN_ID": "none"},
                 r"torchrun.*mpiexec -n {n} python script.py"),
    "srun": ({"SLURM_STEP_NUM_TASKS": "{n}", "SLURM_PROCID": "{rank}", "SLURM_NTASKS": "{n}"},
             r"started by srun.*mpiexec -n {n} python script.py` inside the allocation "
             r"\(or `srun --mpi=pmi2 -n {n} python script.py`\)"),
    "Open MPI's mpiexec": ({"OMPI_COMM_WORLD_SIZE": "{n}", "OMPI_COMM_WORLD_RANK": "{rank}"},
                           r"Open MPI's mpiexec.*mpiexec -n {n} python script.py"),
}
FACES_UNDER = {face: list(LAUNCHERS)[i % len(LAUNCHERS)] for i, face in enumerate(SCRIPTS)}


def _clean_environment():
    """This environment without any launcher's variables (the tests run under one)."""
    drop = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
            "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
            "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE",
            "PMI_RANK", "PMIX_SIZE", "MPI_LOCALNRANKS", "MPIGRAD_ALONE")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PMI")}


def _run(tmp_path, face, n, launcher=None, extra=None):
    """Start ``n`` separate processes of ``face``'s script (a launcher's
    environment for each, where given); their (exit status, output) in rank order."""
    pytest.importorskip(NEEDS.get(face, "numpy"))
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPTS[face]))
    procs = []
    for rank in range(n):
        env = _clean_environment()
        if launcher is not None:
            variables, _ = LAUNCHERS[launcher]
            env.update({k: v.format(n=n, rank=rank) for k, v in variables.items()})
        env.update(extra or {})
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      cwd=tmp_path))
    return [(p.wait(timeout=RUN_SECONDS), p.stdout.read()) for p in procs]


#: (face, processes): every face at 2, the faces without a framework's import at 3 too
CASES = [(face, 2) for face in SCRIPTS] + [("numpy", 3), ("metrics", 3)]


@pytest.mark.parametrize("face, n", CASES)
def test_a_launch_of_separate_worlds_is_refused_on_every_process(tmp_path, face, n):
    import re
    launcher = FACES_UNDER[face]
    for code, out in _run(tmp_path, face, n, launcher):
        assert code != 0 and not re.search("^moved", out, re.M), out
        assert re.search(LAUNCHERS[launcher][1].format(n=n), out), out
        assert "MPI's world has 1 rank" in out and "MPIGRAD_ALONE=1" in out, out


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_every_launcher_is_named_and_alone_is_allowed(tmp_path, launcher):
    import re
    for code, out in _run(tmp_path, "numpy", 2, launcher):
        assert code != 0 and re.search(LAUNCHERS[launcher][1].format(n=2), out), out
    for code, out in _run(tmp_path, "numpy", 2, launcher, {"MPIGRAD_ALONE": "1"}):
        assert code == 0 and "moved [1.0, 1.0, 1.0, 1.0]" in out, out


@pytest.mark.parametrize("face", list(SCRIPTS))
def test_plain_one_rank_use_says_nothing(tmp_path, face):
    ((code, out),) = _run(tmp_path, face, 1)
    assert code == 0 and out.startswith("moved"), out
    assert "Warning" not in out and "rank" not in out.lower().replace("moved", ""), out


def test_one_process_inside_a_batch_allocation_says_nothing(tmp_path):
    """SLURM_NTASKS is the allocation's, not this process's: a one-process
    command inside it is a plain one-rank run."""
    ((code, out),) = _run(tmp_path, "numpy", 1, extra={"SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"})
    assert code == 0 and out.strip() == "moved [1.0, 1.0, 1.0, 1.0]", out

"""The torch.distributed backend's failures that must not crash or hang, as one
`mpiexec` job per rank count under a hard limit (test_job_ends.run_job), every
rank's exit status and output checked: DDP when a rank raises in backward and
makes another call (an agreed error: every rank raises, the group goes on), a
group past its timeout (TimedOut, catchable), then a rank that leaves (its
peers' receive and DDP step raise PeerError naming it, in seconds)."""

import re

import pytest

from test_job_ends import MPIEXEC, run_job

pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found"),
              pytest.mark.timeout(600)]

SCRIPT = """
    import datetime
    import torch, torch.distributed as dist
    import mpigrad.torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("mpigrad")
    last = dist.get_world_size() - 1

    def say(what, exc):
        print(f"rank {rank} {what} {type(exc).__name__}: {exc}".splitlines()[0], flush=True)

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(64, 8)

    x = torch.randn(4, 64)
    first, second = model(), model()
    ddp, ddp2 = DDP(first), DDP(second)
    ddp(x).sum().backward()
    ddp2(x).sum().backward()
    # 1. the last rank raises in backward, then makes another call: agreed
    if rank == last:
        first.weight.register_hook(lambda grad: (_ for _ in ()).throw(ValueError("boom")))
    try:
        ddp(x).sum().backward()
        print(f"rank {rank} backward ok", flush=True)
    except Exception as exc:
        say("backward", exc)
        if rank == last:
            try:
                dist.barrier()
            except Exception as exc:
                say("barrier", exc)
    t = torch.ones(3)
    dist.all_reduce(t)
    print(f"rank {rank} then {t.tolist()}", flush=True)
    # 2. a group past its timeout: rank 0 alone in its barrier
    group = dist.new_group(timeout=datetime.timedelta(seconds=2))
    if rank == 0:
        try:
            dist.barrier(group=group)
        except TimeoutError as exc:
            print(f"rank 0 timeout {type(exc).__name__}: {exc}", flush=True)
    dist.barrier()
    # 3. the last rank leaves: a receive from it, then a DDP step, raise PeerError
    if rank == last:
        dist.destroy_process_group()
        sys.exit(0)
    try:
        dist.recv(torch.zeros(4), src=last)
    except Exception as exc:
        say("recv", exc)
    try:
        ddp2(x).sum().backward()
    except Exception as exc:
        say("step", exc)
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_failures_on_the_backend_raise_on_every_rank_and_end_cleanly(tmp_path, ranks):
    pytest.importorskip("torch")
    code, out, elapsed = run_job(tmp_path, SCRIPT, ranks=ranks, limit=400,
                                 env={"MASTER_ADDR": "", "MPIGRAD_TIMEOUT": "120"})
    last = ranks - 1
    assert code == 0 and "Segmentation" not in out, out
    # 1: the raising rank's own error, then everyone's agreed mismatch; the group goes on
    assert f"rank {last} backward ValueError: boom" in out, out
    assert f"rank {last} barrier StructureMismatchError: " in out, out
    for r in range(last):        # DDP's reducer reports the failed Work as torch's do
        assert re.search(rf"rank {r} backward RuntimeError: .*StructureMismatchError", out), out
    for r in range(ranks):
        assert f"rank {r} then {[float(ranks)] * 3}" in out, out
    # 2: catchable, naming the ranks that did not come
    assert re.search(r"rank 0 timeout TimedOut: .* Timed out waiting .*?ranks that did not "
                     rf"arrive: \[{', '.join(map(str, range(1, ranks)))}\]", out, re.S), out
    # 3: in seconds, not the 120 s watch
    for r in range(last):
        assert re.search(rf"rank {r} recv PeerError: recv from rank {last} .*its peer left", out)
        assert re.search(rf"rank {r} step (RuntimeError: .*)?PeerError: .*\[{last}\]", out), out
    assert elapsed < 100, out


LAUNCH = """
    import os, socket
    import torch, torch.distributed as dist
    from mpi4py import MPI
    import mpigrad.torch
    # 1. torchrun's environment of another world: refused before any rendezvous
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                      TORCHELASTIC_RUN_ID="x")
    try:
        dist.init_process_group("mpigrad")
    except ValueError as exc:
        print(f"rank {rank} refused: {exc}", flush=True)
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        del os.environ[name]
    # 2. a tutorial's MASTER_ADDR and MASTER_PORT lines: torch's TCP store there, MPI's ranks
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ["MASTER_PORT"] = str(MPI.COMM_WORLD.bcast(port))
    dist.init_process_group("mpigrad")
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    # a program that never compiles never imports dynamo (2 s at its first call)
    print(f"rank {rank} dynamo imported: {'torch._dynamo' in sys.modules}", flush=True)
    u = torch.ones(2)
    try:     # torch hands it to the default group: refused, not mpigrad's in gloo's name
        dist.all_reduce(u, group=dist.new_group(backend="gloo"))
    except ValueError as exc:
        print(f"rank {rank} gloo group: {str(exc).splitlines()[0]}", flush=True)
    print(f"rank {rank} of {dist.get_world_size()}: {t.tolist()} {u.tolist()}", flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_launch_environments_work_or_name_the_fix(tmp_path, ranks):
    pytest.importorskip("torch")
    code, out, elapsed = run_job(tmp_path, LAUNCH, ranks=ranks, limit=300)
    assert code == 0, out
    total = float(sum(range(1, ranks + 1)))
    for r in range(ranks):
        assert re.search(rf"rank {r} refused: .*expecting rank {r} of world_size {ranks} .*got "
                         r"rank 0 of world_size 1.*started by torchrun.*mpiexec -n N", out), out
        assert f"rank {r} gloo group: new_group(backend='gloo') under the default group" \
            in out, out
        assert f"rank {r} of {ranks}: {[total] * 2} {[1.0] * 2}" in out, out
        assert f"rank {r} dynamo imported: False" in out, out


UNIMPORTED = """
    import sys
    import torch, torch.distributed as dist
    assert "mpigrad.torch" not in sys.modules
    # 1. torch's env:// rendezvous without RANK: its error names the import
    try:
        dist.init_process_group("mpigrad")
    except ValueError as exc:
        print(f"rank {rank} refused: {exc}", flush=True)
    # 2. a tutorial's variables, with MPI's ranks: the backend, known by name
    # through torch's autoload, made on first use
    port = None
    if rank == 0:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(MPI.COMM_WORLD.size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(MPI.COMM_WORLD.bcast(port)))
    dist.init_process_group("mpigrad")
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    print(f"rank {rank} of {dist.get_world_size()}: {t.tolist()}", flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_without_import_mpigrad_torch_the_backend_works_or_names_the_import(tmp_path, ranks):
    pytest.importorskip("torch")
    from importlib.metadata import entry_points
    assert entry_points(group="torch.backends", name="mpigrad"), \
        "mpigrad's torch autoload hook is not installed: reinstall mpigrad (pip install -e .)"
    env = {name: "" for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    code, out, elapsed = run_job(tmp_path, UNIMPORTED, ranks=ranks, limit=300, env=env)
    assert code == 0, out
    total = float(sum(range(1, ranks + 1)))
    for r in range(ranks):
        assert re.search(rf"rank {r} refused: .*environment variable RANK expected, but not "
                         r"set; with the 'mpigrad' backend, `import mpigrad.torch` before "
                         r"init_process_group", out), out
        assert f"rank {r} of {ranks}: {[total] * 2}" in out, out

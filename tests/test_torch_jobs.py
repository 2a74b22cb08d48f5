"""The torch.distributed backend's jobs that a failure must not crash or hang:
DDP when a rank raises, leaves or makes another call; a group past its
timeout; a receive from a rank that left. Each runs as its own `mpiexec` job
under a hard limit (test_job_ends.run_job), at 2 and 3 ranks: every rank's exit
status and what it printed are checked."""

import re

import pytest

from test_job_ends import MPIEXEC, run_job

pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found"),
              pytest.mark.timeout(600)]


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("how", ["raises in backward", "leaves between steps",
                                 "skips its all_reduce"])
def test_ddp_on_the_backend_raises_a_peers_error_on_every_rank(tmp_path, ranks, how):
    """DDP's bucket all_reduce failing on the "mpigrad" backend: every rank
    raises (the peers mpigrad's error, or from backward a RuntimeError naming
    it, as torch's C++ reducer reports a failed Work of gloo's), none crashes, every rank exits 0;
    where the error was agreed (a rank made another call), the group goes on."""
    pytest.importorskip("torch")
    code, out, elapsed = run_job(tmp_path, f"""
        import torch, torch.distributed as dist
        import mpigrad.torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("mpigrad")
        last = dist.get_world_size() - 1
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 8)
        ddp = DDP(model)
        x = torch.randn(4, 64)
        ddp(x).sum().backward()
        HOW = {how!r}
        if rank == last and HOW == "leaves between steps":
            dist.destroy_process_group()
            sys.exit(0)
        if rank == last and HOW == "raises in backward":
            def boom(grad):
                raise ValueError("boom in a parameter hook")
            model.weight.register_hook(boom)
        try:
            if rank == last and HOW == "skips its all_reduce":
                with ddp.no_sync():
                    ddp(x).sum().backward()
                dist.barrier()
            else:
                ddp(x).sum().backward()
            print(f"rank {{rank}} step 1 ok", flush=True)
        except Exception as exc:
            print(f"rank {{rank}} {{type(exc).__name__}}: {{exc}}".splitlines()[0], flush=True)
        if HOW == "skips its all_reduce":
            t = torch.ones(3)
            dist.all_reduce(t)
            print(f"rank {{rank}} then {{t.tolist()}}", flush=True)
        dist.destroy_process_group()
        """, env={"MASTER_ADDR": ""}, ranks=ranks, limit=240)
    last = ranks - 1
    assert code == 0, out
    peers = range(last)
    if how == "raises in backward":
        assert f"rank {last} ValueError: boom in a parameter hook" in out, out
    if how == "skips its all_reduce":
        assert f"rank {last} StructureMismatchError: " in out, out
        for r in range(ranks):
            assert f"rank {r} then {[float(ranks)] * 3}" in out, out
        error = "StructureMismatchError"
    else:
        error = rf"PeerError: .*\[{last}\]"
    for r in peers:     # raised by DDP's reducer, or by a call of forward's
        assert re.search(rf"rank {r} (RuntimeError: .*)?{error}", out), out


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_torch_group_past_its_timeout_raises_a_catchable_error(tmp_path, ranks):
    """As gloo's: rank 0 alone calls a barrier of a group with a 2 s timeout; it
    raises TimedOut (a TimeoutError, naming the ranks that did not come), the
    other ranks go on, and the job ends normally."""
    pytest.importorskip("torch")
    code, out, elapsed = run_job(tmp_path, """
        import datetime
        import torch, torch.distributed as dist
        import mpigrad.torch
        dist.init_process_group("mpigrad")
        group = dist.new_group(timeout=datetime.timedelta(seconds=2))
        if rank == 0:
            try:
                dist.barrier(group=group)
            except TimeoutError as exc:
                print(f"rank 0 {type(exc).__name__}: {exc}", flush=True)
        dist.barrier()
        t = torch.ones(2)
        dist.all_reduce(t)
        print(f"rank {rank} sum {t.tolist()}", flush=True)
        dist.destroy_process_group()
        """, env={"MASTER_ADDR": "", "MPIGRAD_TIMEOUT": "60"}, ranks=ranks, limit=240)
    assert code == 0, out
    assert re.search(r"rank 0 TimedOut: .* Timed out waiting .*?ranks that did not arrive: "
                     rf"\[{', '.join(map(str, range(1, ranks)))}\]", out, re.S), out
    for r in range(ranks):
        assert f"rank {r} sum {[float(ranks)] * 2}" in out, out


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_torch_recv_from_a_rank_that_left_raises_peer_error(tmp_path, ranks):
    pytest.importorskip("torch")
    code, out, elapsed = run_job(tmp_path, """
        import torch, torch.distributed as dist
        import mpigrad.torch
        dist.init_process_group("mpigrad")
        last = dist.get_world_size() - 1
        if rank == last:
            dist.destroy_process_group()
            sys.exit(0)
        try:
            dist.recv(torch.zeros(4), src=last)
        except Exception as exc:
            print(f"rank {rank} {type(exc).__name__}: {exc}", flush=True)
        """, env={"MASTER_ADDR": "", "MPIGRAD_TIMEOUT": "120"}, ranks=ranks, limit=240)
    assert code == 0, out
    assert elapsed < 100, out                     # not the 120 s watch
    for r in range(ranks - 1):
        assert re.search(rf"rank {r} PeerError: recv from rank {ranks - 1} .*its peer left", out)

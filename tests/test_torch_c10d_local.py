"""The torch.distributed backend "mpigrad" in plain python (a world of one
rank): init_process_group needs no address, and a rank that is not MPI's is
refused, naming both."""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import mpigrad.torch  # noqa: E402,F401  (registers the backend)


@pytest.fixture
def no_address(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_one_rank_needs_no_address_and_reduces(no_address):
    dist.init_process_group("mpigrad")
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "mpigrad")
    t = torch.arange(4.0)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_world_size_that_is_not_mpis_is_refused(no_address):
    with pytest.raises(ValueError, match=r"expecting rank 0 of world_size 1 \(MPI's.*got rank 0 "
                                         r"of world_size 4"):
        dist.init_process_group("mpigrad", rank=0, world_size=4)


def test_a_group_after_the_mpigrad_world_was_destroyed(no_address):
    """destroy_process_group frees the mpigrad world; a later gloo world's
    new_group(backend="mpigrad") of every rank makes a live one again."""
    dist.init_process_group("mpigrad")
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.new_group(backend="mpigrad")
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    assert t.tolist() == [1.0] * 3 and dist.get_backend(group) == "mpigrad"


def test_import_mpigrad_torch_leaves_dynamo_unimported():
    """`import mpigrad.torch` adds little to `import torch` (1.2x measured, 1.3x
    at most: docs/torch-distributed.md): torch's compiler (2.3 s of imports
    here) is imported at the first backend call, not at the import."""
    import subprocess
    import sys
    code = ("import sys, torch, mpigrad.torch; "
            "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.fsdp') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr

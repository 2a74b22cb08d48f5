"""The examples run as documented: mpiexec -n 2 python -m mpi4py examples/..."""

import os
import sys

import pytest

from helpers import mpiexec_path, run_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: an example's job is ended (its processes listed, then killed) past this, inside
#: pytest's own limit per test (setup.cfg: 120 s), whose end would kill only the
#: worker and leave the job holding the worker's pipes (the whole run then waits)
EXAMPLE_SECONDS = 110


def run_example(name, *args, ranks=2, cwd=None):
    mpiexec = mpiexec_path()
    if mpiexec is None:
        pytest.skip("mpiexec not found")
    code, out = run_until([mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py",
                           os.path.join(ROOT, "examples", name), *args], None, EXAMPLE_SECONDS,
                          cwd=cwd)
    assert code == 0, out
    # a warning the example's own code causes is a defect a user would see
    ours = [line for line in out.splitlines()
            if "Warning: " in line and os.path.join(ROOT, "examples") in line]
    assert not ours, "\n".join(ours)
    return out


def test_numpy_sgd_equals_one_rank_full_batch_training():
    # the example exits non-zero when the weights leave its stated tolerance
    assert "equivalent to 1-rank full-batch training: True" in run_example("numpy_sgd.py")


@pytest.mark.parametrize("name, needs", [("numpy_mlp.py", "sklearn"), ("torch_mlp.py", "torch"),
                                         ("torch_amp.py", "torch"),
                                         ("jax_regression.py", "jax"),
                                         ("jax_sharded.py", "optax"),
                                         ("jax_flax_jit.py", "flax"),
                                         ("sharded_adam.py", "torch"),
                                         ("horovod/mnist.py", "torch"),
                                         ("torch_reproducible.py", "torch")])
def test_example_claims_hold(name, needs):
    pytest.importorskip(needs)
    assert "claims hold: True" in run_example(name)


def test_horovod_synthetic_benchmark_runs_and_agrees():
    pytest.importorskip("torch")
    out = run_example("horovod/synthetic_benchmark.py", "--iters", "2", "--rounds", "1")
    assert "claims hold: True" in out and "mpigrad / DDP" in out


@pytest.fixture(scope="module")
def ddp_on_gloo_losses():
    """examples/torch_ddp.py (DDP, DDP with a hook, FSDP2, each against gloo);
    its plain DDP's loss curve on gloo, the reference of the others."""
    pytest.importorskip("torch")
    out = run_example("torch_ddp.py")
    assert "claims hold: True" in out, out
    line = next(line for line in out.splitlines() if line.startswith(("2 ranks, DDP:")))
    return [float(v) for v in line.split("gloo's losses [")[1].rstrip("]").split(", ")]


def test_ddp_fsdp2_and_a_comm_hook_on_mpigrad_match_gloo(ddp_on_gloo_losses):
    assert len(ddp_on_gloo_losses) == 8


@pytest.mark.parametrize("ranks", [2, 3])
def test_torch_compile_of_ddp_and_fsdp2_on_mpigrad_matches_gloo(ranks):
    """torch.compile of DDP (a buffer broadcast in the compiled forward) and of
    FSDP2: the loss curves of gloo within 1e-6, the parameters identical."""
    pytest.importorskip("torch")
    out = run_example("torch_ddp.py", "--compile", ranks=ranks)
    assert "claims hold: True" in out, out
    assert f"{ranks} ranks, torch.compile of DDP:" in out and \
        f"{ranks} ranks, torch.compile of FSDP2:" in out, out


@pytest.mark.parametrize("trainer", ["lightning", "accelerate"])
def test_trainers_on_the_mpigrad_backend_match_ddp_on_gloo(trainer, ddp_on_gloo_losses):
    """The same model, data and steps as torch_ddp.py's plain DDP: the same
    loss curve, within 1e-6."""
    pytest.importorskip(trainer)
    out = run_example("torch_trainers.py", "--trainer", trainer)
    assert "claims hold: True" in out and "on mpigrad: losses" in out, out
    losses = [float(v) for v in out.split("losses [")[1].split("]")[0].split(", ")]
    assert len(losses) == len(ddp_on_gloo_losses)
    assert max(abs(a - b) for a, b in zip(losses, ddp_on_gloo_losses)) <= 1e-6, out

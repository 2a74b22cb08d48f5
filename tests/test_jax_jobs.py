"""mpigrad.jax as a program's first use of mpigrad, as one `mpiexec` job per
rank count under a hard limit (test_job_ends.run_job): the default Reducer
made while the step is traced, and the default metric helper made inside
the first host call of the compiled step, among 24 calls that do not depend
on each other."""

import pytest

from test_job_ends import MPIEXEC, run_job

pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found"),
              pytest.mark.timeout(600)]

SCRIPT = """
    import jax, jax.numpy as jnp
    import mpigrad.jax as mj
    size = MPI.COMM_WORLD.size
    ops = ["reduce", "sum", "mean", "max", "min"]

    @jax.jit
    def step(x):
        return [mj.reduce(jnp.full((256 * (i + 1),), i + rank + 1.0, jnp.float32) * x)
                if ops[i % 5] == "reduce" else
                mj.allreduce(jnp.full((256 * (i + 1),), i + rank + 1.0, jnp.float32) * x,
                             ops[i % 5]) for i in range(24)]
    wrong = []
    for run in range(3):
        for i, got in enumerate(step(jnp.float32(run + 1))):
            values = [(i + r + 1.0) * (run + 1) for r in range(size)]
            want = {"reduce": sum(values) / size, "mean": sum(values) / size,
                    "sum": sum(values), "max": max(values), "min": min(values)}[ops[i % 5]]
            if not np.allclose(np.asarray(got), want, rtol=1e-6):
                wrong.append((run, i))
    print(f"rank {rank} wrong {wrong}", flush=True)
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_mixed_calls_with_the_defaults_made_inside_the_first_step(tmp_path, ranks):
    pytest.importorskip("jax")
    code, out, _ = run_job(tmp_path, SCRIPT, ranks=ranks, limit=300,
                           env={"MPIGRAD_TIMEOUT": "60"})
    assert code == 0, out
    for rank in range(ranks):
        assert f"rank {rank} wrong []" in out, out

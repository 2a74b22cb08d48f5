"""tests/helpers.py's job runner: a job past its limit fails the test with what
its ranks were doing (the Python processes' stacks, through the launcher), and
none of its processes is left."""

import os
import sys

import pytest

from helpers import mpiexec_path, run_until

STUCK = """
import time
def stuck_here():
    time.sleep(600)
stuck_here()
"""


def test_a_hung_job_fails_with_its_ranks_stacks_and_leaves_nothing(tmp_path):
    mpiexec = mpiexec_path()
    if mpiexec is None:
        pytest.skip("mpiexec not found")
    with pytest.raises(pytest.fail.Exception) as failed:
        run_until([mpiexec, "-n", "2", sys.executable, "-c", STUCK], None, limit=8,
                  cwd=tmp_path)
    message = str(failed.value)
    assert "the job hung: the launcher was still running after 8 s" in message
    # a rank's stack (hydra may end the other ranks, or stop passing on their output,
    # once the first has aborted: every rank's is not guaranteed)
    assert "in stuck_here" in message, message
    assert not [name for name in os.listdir(tmp_path) if name.startswith("core")]

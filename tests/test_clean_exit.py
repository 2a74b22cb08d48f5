"""A program that used mpigrad ends without a word on stderr: with or without
jax (and flax and optax, a jax user's usual set) or torch imported, with one
Reducer freed and one left to the interpreter's exit, at 1 rank (plain
python) and at 2 (mpiexec), each job under a hard timeout."""

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from helpers import mpiexec_path

IMPORTS = {"numpy only": [], "jax, flax, optax": ["jax", "flax", "optax"], "torch": ["torch"]}

SCRIPT = """
{imports}
import numpy as np
import mpigrad
kept = mpigrad.Reducer()                   # at module level, never freed
freed = mpigrad.Reducer()
grads = [np.ones(4, np.float32)]
assert np.array_equal(kept.reduce(grads)[0], freed.reduce(grads)[0])
freed.free()
"""


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("frameworks", list(IMPORTS))
def test_exit_is_silent(tmp_path, frameworks, ranks):
    modules = IMPORTS[frameworks]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed")
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent(SCRIPT.format(
        imports="\n".join(f"import {m}" for m in modules))))
    cmd = [sys.executable, str(script)]
    if ranks > 1:
        mpiexec = mpiexec_path()
        if mpiexec is None:
            pytest.skip("mpiexec not found")
        cmd = [mpiexec, "-n", str(ranks)] + cmd
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""

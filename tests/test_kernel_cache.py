"""numba's on-disk cache serves every compiled kernel: a fresh process after a
warm one compiles nothing (the kernels are module-level functions; closures
made inside a function missed the cache and were compiled again by every
process: about 4 s before its first exact sum). The same for the C kernels
(native.py): built once into the cache directory, loaded by every later
process, several processes starting at once build it once."""

import os
import shlex
import subprocess
import sys
import textwrap

import pytest

from helpers import outlasting
from mpigrad._base import native

#: a build's own limit (a cold cache compiles every kernel)
BUILD_SECONDS = 600
pytestmark = outlasting(BUILD_SECONDS)

FIRST_CALLS = {
    "exact": """
        from mpigrad._base import exact
        a = np.random.default_rng(0).standard_normal(1000)
        parts = exact.grow(np.zeros((1, a.size)), a)
        agreed = exact.exponents(parts, np.zeros(a.size))
        words, _ = exact.layout(agreed)
        for dtype, divisor in ((np.float32, 3), (np.float64, 1), (np.float16, 4)):
            exact.round_into(np.empty(a.size, dtype), exact.to_limbs(parts, agreed, words),
                             agreed, divisor)
        f = a.astype(np.float32)
        agreed = exact.exponents_float32(f)
        exact.round_into(np.empty(a.size, np.float32), exact.to_limb_float32(f, agreed),
                         agreed, 2)
    """,
    "halfcast": """
        from mpigrad._base import fused_sum, halfcast
        a = np.ones(1 << 10, np.float32)
        h, b = np.empty(a.size, np.float16), np.empty(a.size, np.uint16)
        halfcast.to_float16(h, a)
        halfcast.to_float32(a, h)
        halfcast.to_bfloat16_bits(b, a)
        fused_sum.sum_bfloat16_rows(b, np.stack([b, b]))
    """,
}


def _run(body, cache_dir, kernels="numba"):
    program = "import numpy as np\n" + textwrap.dedent(body)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir), NUMBA_DEBUG_CACHE="1",
               MPIGRAD_KERNELS=kernels, MPIGRAD_CACHE_DIR=str(cache_dir / "mpigrad"))
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=BUILD_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.parametrize("module", sorted(FIRST_CALLS))
def test_a_fresh_process_after_a_warm_one_compiles_nothing(module, tmp_path):
    first = _run(FIRST_CALLS[module], tmp_path)
    assert "data saved" in first          # the cache (outside the source tree) was written
    second = _run(FIRST_CALLS[module], tmp_path)
    compiled = [line for line in second.splitlines() if "saved" in line]
    assert not compiled, "compiled again in a fresh process:\n" + "\n".join(compiled)
    assert "data loaded" in second


NATIVE = """
    from mpigrad._base import halfcast, native
    a = np.ones(1 << 10, np.float32)
    h = np.empty(a.size, np.float16)
    halfcast.to_float16(h, a)
    print("KERNELS", native.kernels_name())
"""


def _at_once(count, env):
    """The outputs of ``count`` processes of NATIVE started at once with ``env``."""
    runs = [subprocess.Popen([sys.executable, "-c", "import numpy as np\n" +
                              textwrap.dedent(NATIVE)], env=env, stdout=subprocess.PIPE,
                             text=True) for _ in range(count)]
    return [run.communicate(timeout=BUILD_SECONDS)[0] for run in runs]


def test_processes_at_once_build_one_library_and_later_ones_load_it(tmp_path):
    """Three processes starting at once on an empty cache: one compiles (the
    compiler is run once: a wrapper counts it), the others wait and load its
    library; three more load it and build nothing."""
    compiles = tmp_path / "compiles"
    wrapper = tmp_path / "cc"
    compiler = shlex.join(native.compiler())
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {compiles}\nexec {compiler} "$@"\n')
    wrapper.chmod(0o755)
    cache = tmp_path / "mpigrad"
    env = dict(os.environ, MPIGRAD_KERNELS="", CC=str(wrapper), MPIGRAD_CACHE_DIR=str(cache))
    outputs = _at_once(3, env)
    if not any("KERNELS C" in out for out in outputs):
        pytest.skip(f"no C compiler here: {outputs}")
    assert all("KERNELS C" in out for out in outputs), outputs
    assert len(compiles.read_text().splitlines()) == 1, compiles.read_text()
    built = sorted(p for p in cache.iterdir() if p.suffix == ".so")
    assert len(built) == 1, sorted(cache.iterdir())
    stamp = built[0].stat().st_mtime_ns
    assert all("KERNELS C" in out for out in _at_once(3, env))
    assert len(compiles.read_text().splitlines()) == 1         # nothing built again
    assert sorted(p for p in cache.iterdir() if p.suffix == ".so") == built
    assert built[0].stat().st_mtime_ns == stamp


def test_without_a_compiler_the_numba_kernels_give_the_same_bits(tmp_path):
    body = NATIVE + """
    x = np.random.default_rng(0).standard_normal(1 << 17).astype(np.float32)
    out = np.empty(x.size, np.float16)
    halfcast.to_float16(out, x)
    print("BITS", __import__("hashlib").sha256(out.tobytes()).hexdigest())
"""
    runs = {}
    # without a compiler, into a cache of its own; C from this machine's cache (built once)
    for name, env in (("none", dict(os.environ, CC="false", MPIGRAD_CACHE_DIR=str(tmp_path))),
                      ("C", {k: v for k, v in os.environ.items() if k != "CC"})):
        env["MPIGRAD_KERNELS"] = ""
        done = subprocess.run([sys.executable, "-c", "import numpy as np\n" +
                               textwrap.dedent(body)], env=env, capture_output=True, text=True,
                              timeout=BUILD_SECONDS)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[name] = done.stdout
    assert "KERNELS numba (no C kernels" in runs["none"]
    if "KERNELS C" not in runs["C"]:
        pytest.skip(f"no C compiler here: {runs['C'].strip().splitlines()[0]}")
    bits = {name: out.split("BITS")[1] for name, out in runs.items()}
    assert bits["none"] == bits["C"]


def test_a_cache_directory_that_cannot_be_written_leaves_numpys_way(tmp_path):
    """Where the cache directory cannot be made (here: a file of that name), nothing is
    built and nothing raises: the numba kernels and numpy's list copies run instead."""
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    body = """
        from mpigrad import Reducer
        from mpigrad._base import native
        with Reducer() as reducer:
            out = reducer.reduce([np.ones(3, np.float16), np.ones(2, np.float32)] * 3)
        assert all(o.tolist() == [1.0] * o.size for o in out), out
        print("KERNELS", native.kernels_name())
        print("LISTS", native.extension("array_lists")[1])
    """
    env = dict(os.environ, MPIGRAD_KERNELS="", MPIGRAD_CACHE_DIR=str(blocked))
    done = subprocess.run([sys.executable, "-c", "import numpy as np\n" + textwrap.dedent(body)],
                          env=env, capture_output=True, text=True, timeout=BUILD_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "KERNELS numba (no C kernels" in done.stdout and "cache directory" in done.stdout
    assert "LISTS portable: the cache directory" in done.stdout, done.stdout

"""numba's on-disk cache serves every compiled kernel: a fresh process after a
warm one compiles nothing (the kernels are module-level functions; closures
made inside a function missed the cache and were compiled again by every
process: about 4 s before its first exact sum)."""

import os
import subprocess
import sys
import textwrap

import pytest

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
        from mpigrad._base import halfcast
        a = np.ones(1 << 10, np.float32)
        h, b = np.empty(a.size, np.float16), np.empty(a.size, np.uint16)
        halfcast.to_float16(h, a)
        halfcast.to_float32(a, h)
        halfcast.to_bfloat16_bits(b, a)
        halfcast.sum_bfloat16_rows(b, np.stack([b, b]))
    """,
}


def _run(body, cache_dir):
    program = "import numpy as np\n" + textwrap.dedent(body)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir), NUMBA_DEBUG_CACHE="1")
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=600)
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

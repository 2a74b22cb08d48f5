"""The half-precision kernels' throughput on this machine, beside a memory
copy's: which kernels run (C at the vector units' width, or numba's where no
compiler works) and how close each cast and fused sum comes to memcpy."""

import time
from typing import Callable, Dict

import numpy as np

from .._base import halfcast
from .._base.fused_sum import fused_sum
from .._base.bfloat16 import bfloat16_dtype
from .._base.native import kernels_name

__all__ = ["measure_casts", "casts_line"]

_ELEMENTS = 1 << 20


def _best(run: Callable[[], object], repeats: int = 7) -> float:
    """The fastest of ``repeats`` timings of ``run``, in seconds (after one warm-up)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_casts() -> Dict[str, object]:
    """GB/s (bytes read and written) of each kernel on 1 M elements, and memcpy's."""
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal(_ELEMENTS).astype(np.float32)
    f16, b16 = f32.astype(np.float16), np.empty(_ELEMENTS, bfloat16_dtype())
    wide, copy = np.empty_like(f32), np.empty_like(f32)
    other, other_b = np.empty_like(f16), np.empty_like(b16)
    halfcast.to_bfloat16_bits(b16, f32)
    kernels = {     # name: (run, bytes read and written)
        "memcpy float32": (lambda: np.copyto(copy, f32), 8),
        "float16 -> float32": (lambda: halfcast.to_float32(wide, f16), 6),
        "float32 -> float16": (lambda: halfcast.to_float16(f16, f32), 6),
        "float32 -> bfloat16": (lambda: halfcast.to_bfloat16_bits(b16, f32), 6),
        "float32 += float16": (lambda: halfcast.add_half(wide, f16, copy), 10),
        # the node sum's kernel: two ranks' addends, their mean checked, rounded once
        "float16 + float16 -> float16 (mean, check)":
            (lambda: fused_sum(other, [f16, f16], 0.5, 65520.0), 6),
        "bfloat16 + bfloat16 -> bfloat16 (mean, check)":
            (lambda: fused_sum(other_b, [b16, b16], 0.5, 3.3e38), 6),
    }
    rates = {name: per * _ELEMENTS / _best(run) / 1e9 for name, (run, per) in kernels.items()}
    return {"kernels": kernels_name(), "gb_per_s": rates}


def casts_line(casts: Dict[str, object]) -> str:
    """One line: the kernels and each one's GB/s as a fraction of memcpy's."""
    rates = casts["gb_per_s"]
    assert isinstance(rates, dict)
    copy = rates["memcpy float32"]
    parts = [f"{name} {rate:.1f} GB/s ({rate / copy:.2f}x memcpy)"
             for name, rate in rates.items() if name != "memcpy float32"]
    return (f"half-precision kernels: {casts['kernels']}; memcpy {copy:.1f} GB/s; "
            + "; ".join(parts))

"""The compiled float16 casts give numpy's bits: every float16 pattern up, and
down every float32 pattern class that rounding, subnormals, overflow and NaN
depend on, plus random patterns; dtypes.assign takes them without torch."""

import sys

import numpy as np
import pytest

from mpigrad._base import halfcast
from mpigrad._base.dtypes import assign


def _numpy_down(f32):
    with np.errstate(all="ignore"):
        return f32.astype(np.float16)


def test_every_float16_pattern_up_bit_for_bit():
    half = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    out = np.empty(half.size, np.float32)
    halfcast.to_float32(out, half)
    assert np.array_equal(out.view(np.uint32), half.astype(np.float32).view(np.uint32))


def test_every_float16_pattern_round_trips_down():
    half = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    back = np.empty(half.size, np.float16)
    halfcast.to_float16(back, half.astype(np.float32))
    assert np.array_equal(back.view(np.uint16), half.view(np.uint16))


def _down_patterns():
    # every sign, exponent and top-10 significand bits (2**19 prefixes), each
    # with the 13 dropped bits (and sticky bits) at the rounding cases: exact,
    # just below, at and above the half-way point, odd and even kept bits
    prefixes = np.arange(1 << 19, dtype=np.uint32) << 13
    dropped = np.array([0, 1, 2, 0x3FF, 0x400, 0x7FF, 0x800, 0xFFF, 0x1000, 0x1001, 0x17FF,
                        0x1800, 0x1801, 0x1FFE, 0x1FFF, 0x0FFF], np.uint32)
    classes = (prefixes[:, None] | dropped[None, :]).reshape(-1)
    noise = np.random.default_rng(7).integers(0, 1 << 32, 2_000_000, dtype=np.uint64)
    return np.concatenate([classes, noise.astype(np.uint32)]).view(np.float32)


def test_float32_patterns_down_bit_for_bit():
    f32 = _down_patterns()
    out = np.empty(f32.size, np.float16)
    halfcast.to_float16(out, f32)
    want = _numpy_down(f32)
    wrong = np.flatnonzero(out.view(np.uint16) != want.view(np.uint16))
    assert wrong.size == 0, [(hex(f32.view(np.uint32)[i]), hex(out.view(np.uint16)[i]),
                              hex(want.view(np.uint16)[i])) for i in wrong[:5]]


@pytest.mark.parametrize("shape", [(70_000,), (300, 400)])
def test_assign_uses_the_kernels_without_torch(monkeypatch, shape):
    monkeypatch.setitem(sys.modules, "torch", None)       # as if torch were not imported
    calls = []
    for name in ("to_float32", "to_float16"):
        real = getattr(halfcast, name)
        monkeypatch.setattr(halfcast, name,
                            lambda d, s, real=real, name=name: (calls.append(name), real(d, s)))
    src = np.random.default_rng(3).standard_normal(shape).astype(np.float16)
    up = np.empty(shape, np.float32)
    assign(up, src)
    down = np.empty(shape, np.float16)
    assign(down, up * np.float32(1.0001))
    assert calls == ["to_float32", "to_float16"]
    assert np.array_equal(up, src.astype(np.float32))
    assert np.array_equal(down.view(np.uint16),
                          _numpy_down(up * np.float32(1.0001)).view(np.uint16))


def test_assign_leaves_strided_and_small_casts_to_numpy(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(halfcast, "to_float32", lambda d, s: pytest.fail("kernel used"))
    big = np.random.default_rng(4).standard_normal((400, 400)).astype(np.float16)
    strided = np.empty((400, 400), np.float32)
    assign(strided, big.T)                           # not C-contiguous
    assert np.array_equal(strided, big.T.astype(np.float32))
    small = np.empty(100, np.float32)
    assign(small, big[0, :100])
    assert np.array_equal(small, big[0, :100].astype(np.float32))

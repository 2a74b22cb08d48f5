"""The compiled half-precision kernels, C (native.py) and numba, give numpy's
and ml_dtypes' bits: every float16 pattern up, and down every float32 pattern
class that rounding, subnormals, overflow and NaN depend on, plus random
patterns; the C kernels equal the numba ones bit for bit on random data with
subnormals, infinities and NaN payloads (casts, fused sums, row sums);
the fused half sum gives the bits of the casts and sums it replaces; dtypes.assign
takes them without torch."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import outlasting
from mpigrad._base import fused_sum, halfcast, native
from mpigrad._base.bfloat16 import bfloat16_dtype
from mpigrad._base.dtypes import assign


@pytest.fixture(params=["C", "numba"], autouse=True)
def kernels(request, monkeypatch):
    """Every test on each implementation: the C kernels, and numba's (as where no
    compiler works)."""
    if request.param == "C":
        if native.library() is None:
            if shutil.which("cc") or shutil.which("gcc"):
                pytest.fail(f"a C compiler is here, yet {native.kernels_name()}")
            pytest.skip("no C compiler on this machine")
    else:
        monkeypatch.setattr(native, "library", lambda: None)
    return request.param


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


def _halves_with_every_class(n, seed):
    """float16 bits: random normals, subnormals, zeros, infinities and NaNs
    with random payloads (quiet and signalling), both signs."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    special = rng.integers(0, 8, n)
    bits[special == 0] &= 0x83FF                        # subnormal or zero
    bits[special == 1] |= 0x7C00                        # inf or NaN, payload kept
    return bits.view(np.float16)


def _floats_with_every_class(n, seed):
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    special = rng.integers(0, 8, n)
    bits[special == 0] &= 0x807FFFFF                    # float32 subnormal or zero
    bits[special == 1] |= 0x7F800000                    # inf or NaN, payload kept
    bits[special == 2] = (bits[special == 2] & 0x83FFFFFF) | 0x33000000   # half subnormals
    bits[special == 3] = (bits[special == 3] & 0x87FFFFFF) | 0x47000000   # near overflow
    return bits.view(np.float32)


def _both(compute):
    """compute() on the C kernels and on numba's."""
    results = []
    for use_c in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            if not use_c:
                patch.setattr(native, "library", lambda: None)
            results.append(compute())
    return results


@pytest.mark.parametrize("kernels", ["C"], indirect=True)     # it runs both itself
@pytest.mark.parametrize("seed", [0, 1])
def test_the_c_kernels_equal_numbas_bit_for_bit(kernels, seed):
    n = 200_003
    halves, floats = _halves_with_every_class(n, seed), _floats_with_every_class(n, seed)
    bf16 = bfloat16_dtype()
    brain = _floats_with_every_class(n, seed + 10).view(np.uint32) >> 16
    brain = brain.astype(np.uint16).view(bf16)

    def casts():
        up, down, bdown, bup = (np.empty(n, np.float32), np.empty(n, np.float16),
                                np.empty(n, bf16), np.empty(n, np.float32))
        halfcast.to_float32(up, halves)
        halfcast.to_float16(down, floats)
        halfcast.to_bfloat16_bits(bdown, floats)
        halfcast.from_bfloat16_bits(bup, brain)
        acc16, acc_b = floats.copy(), floats.copy()
        halfcast.add_half(acc16, halves, np.empty(n, np.float32))
        halfcast.add_half(acc_b, brain, np.empty(n, np.float32))
        rows16 = np.stack([halves, _halves_with_every_class(n, seed + 1),
                           _halves_with_every_class(n, seed + 2)])
        rows_b = np.stack([brain.view(np.uint16), down.view(np.uint16), bdown.view(np.uint16)])
        sums16 = [np.empty(n, np.float16) for _ in range(3)]
        sums_b = [np.empty(n, np.uint16) for _ in range(3)]
        for out16, out_b, (rows, scale) in zip(sums16, sums_b,
                                               [(1, 1.0), (3, 0.25), (2, 0.5)]):
            fused_sum.sum_float16_rows(out16, rows16[:rows], scale)
            fused_sum.sum_bfloat16_rows(out_b, rows_b[:rows], scale)
        return [a.view(np.uint8) for a in (up, down, bdown, bup, acc16, acc_b, *sums16,
                                          *sums_b)]

    c, numba = _both(casts)
    names = ["float16 up", "float16 down", "bfloat16 down", "bfloat16 up", "float16 added",
             "bfloat16 added", *(f"float16 rows {k}" for k in (1, 3, 2)),
             *(f"bfloat16 rows {k}" for k in (1, 3, 2))]
    # where both addends of a fused sum are NaN, numpy's np.add (the numba path's)
    # keeps the first's payload in its vector loop and the second's in its scalar
    # tail; the C kernels always keep the first's, quieted
    both_nan = np.isnan(floats) & np.isnan(halves)
    both_nan_b = np.isnan(floats) & np.isnan(brain.astype(np.float32))
    for name, mine, theirs in zip(names, c, numba):
        mine, theirs = mine.view(np.uint32 if mine.size == 4 * n else np.uint16), \
            theirs.view(np.uint32 if theirs.size == 4 * n else np.uint16)
        same = mine == theirs
        if name.endswith("added"):
            nan = both_nan if name.startswith("float16") else both_nan_b
            assert np.array_equal(mine[nan], floats.view(np.uint32)[nan] | 0x400000), name
            same |= nan
        assert same.all(), (name, np.flatnonzero(~same)[:5])


def _composed_sum(addends, factor, limit):
    """fused_sum's result the long way (what the node sum did before the fused kernel): cast
    the first addend up, add each other, scale, check, round: (float32 sums, finite)."""
    up = halfcast.to_float32 if addends[0].dtype == np.float16 else halfcast.from_bfloat16_bits
    acc = np.empty(addends[0].size, np.float32)
    up(acc, addends[0])
    for addend in addends[1:]:
        halfcast.add_half(acc, addend, np.empty_like(acc))
    if factor is not None:
        acc *= np.float32(factor)
    finite = None if limit is None else bool(np.all(np.abs(acc) < limit))
    return acc, finite


def _assert_fused_sum(addends, factor, limit, want, finite):
    """fused_sum of ``addends`` gives ``want``'s bits and the ``finite`` flag: into a new
    array of its dtype, streamed past the cache from any alignment on, and written over
    its first or last addend."""
    out = np.empty(want.size, want.dtype)
    assert fused_sum.fused_sum(out, addends, factor, limit) is finite
    assert np.array_equal(out.view(np.uint8), want.view(np.uint8))
    for shift in (0, 1, 7):
        room = np.full(want.size + shift, 7, want.dtype)[shift:]
        assert fused_sum.fused_sum(room, addends, factor, limit, stream=True) is finite
        assert np.array_equal(room.view(np.uint8), want.view(np.uint8)), shift
    for into in {0, len(addends) - 1}:
        in_place = [a.copy() for a in addends]
        assert fused_sum.fused_sum(in_place[into], in_place, factor, limit) is finite
        assert np.array_equal(in_place[into].view(np.uint8), want.view(np.uint8)), into


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
@pytest.mark.parametrize("count, factor, limit, ordinary", [
    (2, None, None, False), (2, 0.5, 65520.0, False), (3, 1 / 3, 65520.0, True),
    (1, None, np.inf, False), (4, 0.25, np.inf, True), (3, 1 / 3, None, False)])
def test_the_fused_half_sum_gives_the_bits_of_the_casts_and_sums_it_fuses(half, count, factor, limit,
                                                                 ordinary):
    n = 200_003                    # neither a multiple of the block nor of the vector width
    seeds = range(20, 20 + count)
    if half == "float16":
        addends = [(np.random.default_rng(s).standard_normal(n).astype(np.float16) if ordinary
                    else _halves_with_every_class(n, s)) for s in seeds]
        down, dtype = halfcast.to_float16, np.float16
    else:
        addends = [((np.random.default_rng(s).standard_normal(n).astype(np.float32) if ordinary
                     else _floats_with_every_class(n, s)).view(np.uint32) >> 16)
                   .astype(np.uint16).view(bfloat16_dtype()) for s in seeds]
        down, dtype = halfcast.to_bfloat16_bits, bfloat16_dtype()
    wide, finite = _composed_sum(addends, factor, limit)
    want = np.empty(n, dtype)
    down(want, wide)
    assert finite is (None if limit is None else ordinary)

    _assert_fused_sum(addends, factor, limit, want, finite)
    out_wide = np.empty(n, np.float32)
    assert fused_sum.fused_sum(out_wide, addends, factor, limit) is finite
    assert np.array_equal(out_wide.view(np.uint32), wide.view(np.uint32))


def _float32_reference(addends, factor, limit):
    """fused_sum's float32 result the long way: numpy's adds in order, where the sum so
    far is a NaN keeping its payload (quieted, as the C kernels' add), then the scale
    and the check."""
    acc = addends[0].copy()
    with np.errstate(all="ignore"):
        for addend in addends[1:]:
            total = acc + addend
            nan = np.isnan(acc)
            total[nan] = (acc.view(np.uint32)[nan] | 0x400000).view(np.float32)
            acc = total
        if factor is not None:
            acc *= np.float32(factor)
    finite = None if limit is None else bool(np.all(np.abs(acc) < limit))
    return acc, finite


@pytest.mark.parametrize("count, factor, limit, ordinary", [
    (2, None, None, False), (2, 0.5, np.inf, False), (3, 1 / 3, 65520.0, True),
    (1, None, np.inf, True), (4, 0.25, np.inf, True), (3, 1 / 3, None, False)])
def test_the_fused_float32_sum_gives_numpys_bits(count, factor, limit, ordinary):
    n = 200_003
    addends = [(np.random.default_rng(s).standard_normal(n).astype(np.float32) if ordinary
                else _floats_with_every_class(n, s)) for s in range(30, 30 + count)]
    want, finite = _float32_reference(addends, factor, limit)
    assert finite is (None if limit is None else ordinary)
    _assert_fused_sum(addends, factor, limit, want, finite)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("limit", [0.0, -1.0, np.nan])
def test_a_limit_no_value_is_below_finds_every_sum_past_it(dtype, limit):
    addends = [np.random.default_rng(s).standard_normal(1024).astype(dtype) for s in (1, 2)]
    want = np.empty(1024, dtype)
    assert fused_sum.fused_sum(want, addends, 0.5, None) is None
    out = np.empty(1024, dtype)
    assert fused_sum.fused_sum(out, addends, 0.5, limit) is False
    assert np.array_equal(out.view(np.uint8), want.view(np.uint8))


_PORTABLE_SUMS = """
import sys
import numpy as np
from mpigrad._base import fused_sum, native
assert native.kernels_name().startswith("C (portable"), native.kernels_name()
halves, floats = np.load(sys.argv[1]), np.load(sys.argv[2])
outs = {}
for count, factor, limit in ((2, None, None), (3, 1 / 3, 65520.0)):
    for dtype, addends in ((np.float16, halves), (np.uint16, halves), (np.float32, floats)):
        out = np.empty(addends.shape[1], dtype)
        fused_sum.fused_sum(out, list(addends[:count].view(dtype)), factor, limit)
        outs[f"{count}-{np.dtype(dtype).name}"] = out
np.savez(sys.argv[3], **outs)
"""


#: the portable build's own limit (it compiles the C kernels afresh)
PORTABLE_BUILD_SECONDS = 600


@outlasting(PORTABLE_BUILD_SECONDS)
@pytest.mark.parametrize("kernels", ["C"], indirect=True)
def test_the_portable_c_build_gives_the_vector_paths_bits(kernels, tmp_path):
    """The C kernels built without the CPU's extensions (MPIGRAD_KERNELS=portable: the
    blockwise sum of a machine without AVX2) give the vector path's bits."""
    n = 100_003
    halves = np.stack([_halves_with_every_class(n, seed).view(np.uint16) for seed in (5, 6, 7)])
    floats = np.stack([_floats_with_every_class(n, seed) for seed in (5, 6, 7)])
    np.save(tmp_path / "halves.npy", halves)
    np.save(tmp_path / "floats.npy", floats)
    subprocess.run([sys.executable, "-c", _PORTABLE_SUMS, str(tmp_path / "halves.npy"),
                    str(tmp_path / "floats.npy"), str(tmp_path / "sums.npz")], check=True,
                   timeout=PORTABLE_BUILD_SECONDS, env=dict(os.environ, MPIGRAD_KERNELS="portable"))
    theirs = np.load(tmp_path / "sums.npz")
    for count, factor, limit in ((2, None, None), (3, 1 / 3, 65520.0)):
        for dtype, addends in ((np.float16, halves), (np.uint16, halves), (np.float32, floats)):
            out = np.empty(n, dtype)
            fused_sum.fused_sum(out, list(addends[:count].view(dtype)), factor, limit)
            key = f"{count}-{np.dtype(dtype).name}"
            assert np.array_equal(out.view(np.uint8), theirs[key].view(np.uint8)), key


def test_bfloat16_down_as_ml_dtypes_rounds():
    f32 = _down_patterns()
    out = np.empty(f32.size, bfloat16_dtype())
    halfcast.to_bfloat16_bits(out, f32)
    with np.errstate(all="ignore"):
        want = f32.astype(bfloat16_dtype())
    mine, theirs = out.view(np.uint16), want.view(np.uint16)
    nan = np.isnan(f32)          # ml_dtypes quiets a NaN: the same class, its own payload
    assert np.array_equal(mine[~nan], theirs[~nan])
    assert np.isnan(out[nan].astype(np.float32)).all()


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

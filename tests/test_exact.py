"""Exact sums (mpigrad._base.exact, mpigrad.ExactSum): the correctly rounded
sum of every addend, whatever their order or grouping, against an exact
reference (fractions, rounded once)."""

import itertools
import math

import numpy as np
import pytest

from helpers import assert_bitwise_equal, exact_reference
from mpigrad import ExactSum
from mpigrad._base import exact
from mpigrad._base.dtypes import bfloat16

DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), bfloat16]


def adversarial(count, size, dtype, seed=0, spread=None):
    """``count`` arrays of ``dtype``: magnitudes across the dtype's range (10
    to the +-``spread``), exact cancellations, subnormals, signed zeros."""
    rng = np.random.default_rng(seed)
    spread = spread or {2: 4, 4: 30, 8: 30}[np.dtype(dtype).itemsize]
    out = []
    for k in range(count):
        values = rng.standard_normal(size) * 10.0 ** rng.integers(-spread, spread, size)
        out.append(values.astype(dtype))
    smallest = np.finfo(np.float32 if dtype == bfloat16 else dtype).smallest_subnormal
    for k in range(count):
        out[k][0] = -out[(k + 1) % count][0] if k % 2 == 0 else out[k][0]   # cancellations
        out[k][1] = np.asarray(smallest * (k + 1)).astype(dtype)           # subnormals
        out[k][2] = np.asarray(-0.0 if k % 3 else 0.0).astype(dtype)      # signed zeros
        out[k][3] = np.asarray(-0.0).astype(dtype)                          # only -0: +0
    return out


def exact_sums(arrays, divisor=1):
    """The exact module's result for one addend per array, as the ranks
    would: exponents agreed, limbs summed, rounded once."""
    parts = [a.astype(np.float64)[None, :] for a in arrays]
    special = np.zeros(arrays[0].size)
    agreed = np.max([exact.exponents(p, special) for p in parts], axis=0)
    words, _ = exact.layout(agreed)
    limbs = sum(exact.to_limbs(p, agreed, words) for p in parts)
    out = np.empty(arrays[0].size, arrays[0].dtype)
    exact.write_results([out], limbs, agreed, None, divisor)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("divisor", [1, 3, 8])
def test_the_sum_is_the_exact_sum_rounded_once(dtype, divisor):
    arrays = adversarial(6, 300, dtype)
    want = exact_reference([[a] for a in arrays], divisor)[0]
    assert_bitwise_equal(exact_sums(arrays, divisor), want, dtype.name)


@pytest.mark.parametrize("divisor", [1, 2, 6])
def test_one_limb_per_element_rounds_as_the_exact_sum(divisor):
    """Magnitudes within a few decades: every element fits one limb, rounded
    to odd at 53 bits and cast (the fast path), or divided exactly."""
    arrays = adversarial(6, 2000, np.float32, seed=9, spread=2)
    assert exact.layout(np.max([exact.exponents_float32(a) for a in arrays], axis=0))[0] == 1
    want = exact_reference([[a] for a in arrays], divisor)[0]
    assert_bitwise_equal(exact_sums(arrays, divisor), want)
    agreed = np.max([exact.exponents_float32(a) for a in arrays], axis=0)
    limbs = sum(exact.to_limb_float32(a, agreed) for a in arrays)
    got = np.empty(2000, np.float32)
    exact.round_into(got, limbs, agreed, divisor)
    assert_bitwise_equal(got, want, "straight from float32 bits")


def _float32_blocks(arrays, block, divisor):
    """The float32 path of a call (engine/exact.py), ranks simulated: block
    exponents agreed, blocks wider than a limb zeroed, limbs summed, written."""
    agreed = np.max([exact.exponents_float32(a, block) for a in arrays], axis=0)
    pairs, apart = exact.split_blocks(agreed, block, arrays[0].size)
    limbs = sum(exact.to_limb_float32(a, pairs) for a in arrays)
    out = np.full(arrays[0].size, np.nan, np.float32)
    halves = [out[:out.size // 3], out[out.size // 3:]]      # written end to end
    exact.write_float32(halves, limbs, pairs, divisor)
    return agreed, pairs, apart, limbs, out


@pytest.mark.parametrize("block", [1, 32])
@pytest.mark.parametrize("divisor", [1, 2, 3, 8])
def test_the_c_kernels_of_float32_exact_sums_equal_numbas(monkeypatch, block, divisor):
    """Every intermediate and result of the float32 path, bit for bit, C
    against numba, on values with subnormals, infinities, NaNs and zeros."""
    from mpigrad._base import native
    if native.library() is None:
        pytest.skip(native.kernels_name())
    arrays = adversarial(3, 5001, np.float32, seed=11, spread=3)
    rng = np.random.default_rng(5)
    for a in arrays:
        specials = rng.integers(0, a.size, 40)
        a[specials[:10]] = np.inf
        a[specials[10:20]] = -np.inf
        a[specials[20:30]] = np.nan
        a[specials[30:]] = np.float32(1e-44) * rng.integers(1, 9, 10)
    c = _float32_blocks(arrays, block, divisor)
    monkeypatch.setattr(native, "library", lambda: None)
    numba = _float32_blocks(arrays, block, divisor)
    for name, mine, theirs in zip(["exponents", "pairs", "apart", "limbs", "results"], c, numba):
        assert mine.dtype == theirs.dtype and np.array_equal(
            mine.view(np.uint8), theirs.view(np.uint8)), name
    assert c[2].size > 0                   # some blocks were wide: summed apart in a call


@pytest.mark.parametrize("divisor", [1, 4, 3])
def test_the_c_rounding_of_sums_wider_than_53_bits_equals_numbas(monkeypatch, divisor):
    """Summed limbs of 2**53 and wider (32 ranks and more), among narrow ones
    in one pass over the blocks and in a pass of their own: rounded to odd
    before the cast, C bit for bit as numba, as the exact value rounds (by 3:
    the long division, as C leaves such sums)."""
    from mpigrad._base import native
    if native.library() is None:
        pytest.skip(native.kernels_name())
    rng = np.random.default_rng(8)
    count, n = 64, 64 * 5 + 17                  # passes over the blocks, the last cut short
    limbs = rng.integers(-(1 << 40), 1 << 40, (n, 1), dtype=np.int64)
    wide = rng.integers(0, 64 * 2, 30)          # in the first two passes only
    limbs[wide, 0] = rng.integers(1 << 53, 1 << 62, 30) * rng.choice([-1, 1], 30)
    # just past a float32 tie: rounded to nearest at 53 bits first, they would tie and
    # round to even (down); exactly, they round up
    limbs[wide[:10], 0] = ((1 << 60) + (1 << 36) + 1) * rng.choice([-1, 1], 10)
    pairs = np.stack([np.full(count, 5, np.int16),
                      rng.integers(-20, 160, count).astype(np.int16)], axis=1).reshape(-1)

    def written():
        out = np.full(n, np.nan, np.float32)
        exact.write_float32([out[:100], out[100:]], limbs, pairs, divisor)
        return out
    c = written()
    monkeypatch.setattr(native, "library", lambda: None)
    assert np.array_equal(c.view(np.uint32), written().view(np.uint32))
    if divisor == 3:
        return
    exact_value = [math.ldexp(float(limbs[i, 0]), -int(pairs[2 * (i % count) + 1]))
                   / divisor for i in wide[:10]]          # 2**60 + 2**36 + 1: exact in python
    assert c[wide[:10]].tolist() == [np.float32(np.nextafter(np.float32(abs(v)), np.inf)
                                                ) * np.sign(v) for v in exact_value]


def test_math_fsum_agrees_in_float64():
    arrays = adversarial(5, 400, np.float64, seed=3)
    want = np.array([math.fsum(float(a[i]) for a in arrays) for i in range(400)])
    assert_bitwise_equal(exact_sums(arrays), want)


def test_an_exact_zero_is_plus_zero_as_math_fsum_gives():
    zeros = [np.array([-0.0, -0.0, 1.0], np.float32), np.array([-0.0, 0.0, -1.0], np.float32)]
    got = exact_sums(zeros)
    assert not np.signbit(got).any()


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16)],
                         ids=lambda d: d.name)
def test_overflow_rounds_to_inf_as_ieee_does(dtype):
    big = np.finfo(dtype).max
    arrays = [np.array([big, big, -big], dtype), np.array([big, -big, big], dtype)]
    got = exact_sums(arrays)
    assert got[0] == np.inf and got[1] == 0 and got[2] == 0


def test_exact_sum_bits_do_not_depend_on_order_or_grouping():
    arrays = adversarial(8, 500, np.float32, seed=5)
    want = exact_reference([[a] for a in arrays])[0]
    for order in itertools.islice(itertools.permutations(range(8)), 0, 40, 7):
        acc = ExactSum()
        for k in order:
            acc.add([arrays[k]])
        assert acc.count == 8
        assert_bitwise_equal(acc.sums()[0], want, f"order {order}")


def test_exact_sum_of_a_pytree_keeps_its_structure_and_dtypes():
    rng = np.random.default_rng(0)
    trees = [{"w": rng.standard_normal((3, 4)).astype(np.float32),
              "h": rng.standard_normal(5).astype(np.float16),
              "c": (rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex64)}
             for _ in range(4)]
    acc = ExactSum()
    for tree in trees:
        acc.add(tree)
    got = acc.sums()
    want = exact_reference(trees)
    assert sorted(got) == ["c", "h", "w"]
    for key in got:
        assert_bitwise_equal(got[key], want[key], key)


def test_non_finite_addends_win_their_element():
    acc = ExactSum()
    acc.add([np.array([np.inf, np.inf, np.nan, 1.0], np.float32)])
    acc.add([np.array([1.0, -np.inf, 2.0, 2.0], np.float32)])
    got = acc.sums()[0]
    assert got[0] == np.inf and np.isnan(got[1]) and np.isnan(got[2]) and got[3] == 3.0


def test_exact_sum_refuses_what_it_cannot_sum():
    acc = ExactSum()
    with pytest.raises(ValueError, match="nothing was added"):
        acc.sums()
    acc.add([np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match=r"expecting gradients like the first added .*"
                                         r"float32\[3\].* got .*float32\[4\]"):
        acc.add([np.zeros(4, np.float32)])
    with pytest.raises(TypeError, match="expecting a floating or complex dtype"):
        ExactSum().add([np.zeros(3, np.int32)])
    assert acc.count == 1


@pytest.mark.parametrize("flush", [False, True], ids=["", "denormals flushed"])
def test_the_c_limbs_of_any_bits_and_pairs_equal_numbas(monkeypatch, request, flush):
    """The vector lanes' limbs and the element formula's, bit for bit against numba,
    on random bits (every exponent, NaNs, infinities, subnormals) against random
    lowest bits (in range, past it, the ZERO sentinel), whatever a call agreed; also
    on a thread that flushes denormals (torch.set_flush_denormal: a float64 lane would
    read a subnormal as 0)."""
    from mpigrad._base import native
    if native.library() is None:
        pytest.skip(native.kernels_name())
    if flush:
        torch = pytest.importorskip("torch")
        assert torch.set_flush_denormal(True)
        request.addfinalizer(lambda: torch.set_flush_denormal(False))
    rng = np.random.default_rng(21)
    values = rng.integers(0, 1 << 32, 40_003, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values[::7] = np.float32(1.5) * np.float32(2.0) ** rng.integers(-30, 30, values[::7].size)
    subnormal = values[3::11].view(np.uint32)
    subnormal &= np.uint32(0x807FFFFF)                                 # exponent 0
    for count in (1, 64, 1000):
        bottoms = rng.integers(-140, 200, count)
        bottoms[::5] = exact.ZERO
        bottoms[1::9] = rng.integers(-20, 40, bottoms[1::9].size)      # common shifts
        bottoms[2::9] = rng.integers(149, 177, bottoms[2::9].size)     # subnormals' own
        pairs = np.stack([np.full(count, 3), bottoms], axis=1).astype(np.int16).reshape(-1)
        c = exact.to_limb_float32(values, pairs)
        with monkeypatch.context() as patched:
            patched.setattr(native, "library", lambda: None)
            numba = exact.to_limb_float32(values, pairs)
        assert np.array_equal(c, numba), count


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("divisor", [1, 4, 3, 6])
def test_the_c_rounding_into_half_precision_equals_numbas(monkeypatch, dtype, divisor):
    """Sums rounded to odd at float32 (vector lanes and elements), then to nearest
    float16 or bfloat16: C bit for bit as numba, the last pass over the blocks cut short;
    a divisor that is not a power of two divides in float64 in C, exactly by long
    division in numba."""
    from mpigrad._base import native
    if native.library() is None:
        pytest.skip(native.kernels_name())
    rng = np.random.default_rng(4)
    count, n = 96, 96 * 7 + 13
    limbs = rng.integers(-(1 << 50), 1 << 50, (n, 1), dtype=np.int64)
    limbs[::3, 0] >>= rng.integers(0, 50, limbs[::3].size)              # every width
    # a unit past or short of a tie of the half-precision neighbours, 2**42 + 2**31
    # (float16) or + 2**34 (bfloat16): a float32 rounded to nearest would tie them
    tie = (1 << 42) + (1 << (31 if dtype == np.float16 else 34))
    limbs[1::4, 0] = (tie + rng.choice([-1, 1], limbs[1::4].size)) * rng.choice([-1, 1],
                                                                              limbs[1::4].size)
    pairs = np.stack([np.full(count, 5), rng.integers(28, 36, count)],
                     axis=1).astype(np.int16).reshape(-1)

    def written():
        out = np.zeros(n, dtype)
        exact.write_float32([out[:101], out[101:]], limbs, pairs, divisor)
        return out.view(np.uint16)
    c = written()
    monkeypatch.setattr(native, "library", lambda: None)
    assert np.array_equal(c, written())


def one_pass_addends(dtype, size=1_025):
    """Three arrays of ``dtype`` for the one-pass sum: adversarial values (a few
    decades), runs wider than a limb (a value 1e30 or 2**-40 of its run's),
    infinities and a NaN (the last, short run's too); runs of ties of the half
    precisions' neighbours (1 + a half unit + 2**-24); runs whose sums are float32
    subnormals (bfloat16 holds them)."""
    arrays = adversarial(3, size, dtype, seed=41, spread=3)
    rng = np.random.default_rng(43)
    big = 1e30 if dtype != np.float16 else 6e4
    for k, a in enumerate(arrays):
        a[rng.integers(0, size, 8)] = (np.asarray(big if k else 2.0 ** -40, np.float32)
                                       .astype(dtype))
        a[rng.integers(0, size, 3)] = (np.inf, -np.inf, np.nan)[k]
    arrays[0][-1] = np.inf                  # the last run (one element) summed apart
    unit = {np.dtype(np.float16): 2.0 ** -11, bfloat16: 2.0 ** -8}.get(np.dtype(dtype), 2.0 ** -24)
    for k, value in enumerate([1.0, unit, 2.0 ** -24]):
        arrays[k][96:160] = np.asarray(value, dtype)
    tiny = rng.standard_normal((3, 256)) * 2.0 ** -128 * (2.0 ** 100 if dtype == np.float16
                                                            else 1.0)
    for k in range(3):
        arrays[k][256:512] = tiny[k].astype(dtype)
    return arrays


def reference(addends, divisor):
    """The exact sum over the ``addends`` (fractions) rounded once; where some
    addend is not finite, the float64 sum of those addends, in order."""
    finite = [np.where(np.isfinite(a.astype(np.float64)), a, 0).astype(a.dtype) for a in addends]
    want = exact_reference([[a] for a in finite], divisor)[0]
    special = np.zeros(addends[0].size)
    for a in addends:
        wide = a.astype(np.float64)
        special += np.where(np.isfinite(wide), 0.0, wide)
    odd = special != 0
    want[odd] = (special[odd] / divisor).astype(want.dtype)
    return want


@pytest.mark.parametrize("flush", [False, True], ids=["", "denormals flushed"])
@pytest.mark.parametrize("divisor", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), bfloat16],
                         ids=lambda d: d.name)
def test_the_one_pass_sum_is_the_exact_sum_rounded_once(request, dtype, divisor, flush):
    """exact.sum_in_one_pass (the node's pass: runs of values summed in float64 where
    they fit one limb, divided, rounded once, half precision to odd at float32 first;
    the other runs element by element) against the exact sum by fractions, every
    element bitwise, 1 to 3 addends, into new memory and into an addend's: values a
    few decades apart, runs wider than a limb, infinities and NaN, sums a unit past or
    short of a tie of a half precision's neighbours and among float32's subnormals;
    also on a thread that flushes denormals (torch.set_flush_denormal)."""
    from mpigrad._base import native
    if native.library() is None:
        pytest.skip(native.kernels_name())
    torch = pytest.importorskip("torch") if flush else None
    arrays = one_pass_addends(dtype)
    for count in (1, 2, 3):
        addends = arrays[:count]
        want = reference(addends, divisor)
        if torch is not None:               # the reference above without, the pass with
            assert torch.set_flush_denormal(True)
            request.addfinalizer(lambda: torch.set_flush_denormal(False))
        got = np.zeros(addends[0].size, dtype)
        exact.sum_in_one_pass(got, addends, divisor)
        into = addends[-1].copy()
        exact.sum_in_one_pass(into, addends[:-1] + [into], divisor)
        if torch is not None:
            torch.set_flush_denormal(False)
        assert_bitwise_equal(got, want, f"{count} addends")
        assert_bitwise_equal(into, want, f"{count} addends, in place")

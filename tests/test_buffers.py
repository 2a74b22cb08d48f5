"""Serial tests of pack / unpack: casts exact, layouts honoured, views reused."""

import weakref

import numpy as np
import pytest

from mpigrad._backends.mpi import joined
from mpigrad._engine.buffers import BucketBuffers, message_runs
from mpigrad._base.dtypes import bfloat16
from mpigrad._engine.plan import DENSE, GradSpec, make_plan


def buffers_for(grads):
    return BucketBuffers(make_plan([GradSpec(DENSE, g.shape, g.dtype) for g in grads]),
                         [g.dtype for g in grads])


@pytest.mark.parametrize("half", [np.float16, bfloat16])
def test_half_upcast_and_back_is_exact_for_every_bit_pattern(half):
    bits = np.arange(1 << 16, dtype=np.uint16)
    grads = [bits.view(half).reshape(256, 256)]
    buffers = buffers_for(grads)
    with np.errstate(invalid="ignore"):
        wide = buffers.pack(0, grads)
        out = [np.empty_like(grads[0])]
        buffers.unpack(0, out)
        want = grads[0].astype(np.float32)
    assert wide.dtype == np.float32
    finite = ~np.isnan(want.reshape(-1))
    assert np.array_equal(wide[finite].view(np.uint32), want.reshape(-1)[finite].view(np.uint32))
    assert np.isnan(wide[~finite]).all()
    back = out[0].reshape(-1).view(np.uint16)
    assert np.array_equal(back[finite], bits[finite])


def test_cast_back_rounds_once_to_nearest_even():
    grads = [np.zeros(4, np.float16)]
    buffers = buffers_for(grads)
    buffers.arrays[0][...] = [1 + 2**-11, 1 + 3 * 2**-11, 70000.0, 2**-25]
    out = [np.empty(4, np.float16)]
    with np.errstate(over="ignore"):
        buffers.unpack(0, out)
    assert out[0].tolist() == [1.0, 1 + 2 * 2**-10, np.inf, 0.0]


def test_logical_order_for_fortran_and_strided_inputs():
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    grads = [np.asfortranarray(base), np.arange(24, dtype=np.float32)[::2].reshape(3, 4)]
    buffers = buffers_for(grads)
    flat = buffers.pack(0, grads)
    assert flat.tolist() == list(range(12)) + list(range(0, 24, 2))
    outs = [None, None]
    results = buffers.new_outputs(grads, outs)
    buffers.unpack_new(0, outs, results)
    assert outs[0].flags.f_contiguous and np.array_equal(outs[0], base)
    assert np.array_equal(outs[1], grads[1])


def test_new_outputs_are_views_of_one_arena_per_dtype():
    grads = [np.ones((2, 3), np.float16), np.full(5, 2, np.float16), np.ones(3, bfloat16)]
    buffers = buffers_for(grads)
    buffers.pack(0, grads)
    outs = [None] * 3
    results = buffers.new_outputs(grads, outs)
    buffers.unpack_new(0, outs, results)
    assert outs[0].dtype == np.float16 and outs[0].base is outs[1].base is results.arenas[outs[0].dtype]
    assert outs[2].dtype == bfloat16 and outs[2].base is results.arenas[bfloat16]
    assert not np.shares_memory(outs[0], buffers.arrays[0])
    for o, g in zip(outs, grads):
        assert np.array_equal(o, g)


def test_result_memory_reused_only_when_no_result_is_referenced():
    grads = [np.ones((4, 5), np.float32), np.ones(7, np.float16)]
    buffers = buffers_for(grads)

    def arenas_of_a_call():
        outs = [None, None]
        results = buffers.new_outputs(grads, outs)
        return outs, {dtype: a.ctypes.data for dtype, a in results.arenas.items()}

    outs, first = arenas_of_a_call()
    kept = outs[0][1:, ::2]                 # a view of one result keeps its arena
    del outs
    outs, second = arenas_of_a_call()
    assert second[np.dtype(np.float32)] != first[np.dtype(np.float32)]
    assert second[np.dtype(np.float16)] == first[np.dtype(np.float16)]
    assert kept.base is not None and np.shares_memory(kept, kept.base)
    del outs, kept
    _, third = arenas_of_a_call()
    assert third == second


def test_results_held_while_the_next_call_is_made_alternate_between_two_arenas():
    """``out = reducer.reduce(grads)`` in a loop holds one call's results while it
    makes the next: they alternate between two arenas, none made afresh."""
    grads = [np.ones((4, 5), np.float32)]
    buffers = buffers_for(grads)
    arenas = []                              # weak: a reference would keep one in use
    out = None
    for call in range(6):
        made = [None]
        buffers.new_outputs(grads, made)
        out = made[0]                        # the last call's results, held until here
        if call < 2:
            arenas.append(weakref.ref(out.base))
        assert out.base is arenas[call % 2](), call


def test_joined_takes_only_arrays_back_to_back_in_one_allocation():
    a, b = np.zeros(100, np.float32), np.zeros(100, np.float32)
    run = joined([a[0:10], a[10:30]])
    assert run.base is a and run.size == 30 and run.ctypes.data == a.ctypes.data
    assert joined([b[30:40], b[40:50]]).ctypes.data == b[30:].ctypes.data
    alone = np.zeros(5, np.float32)
    assert joined([alone]) is alone
    for apart in ([a[0:10], a[20:30]], [a[0:10], b[10:20]], [a[10:20], a[0:10]],
                  [a[0:10], a[10:20].view(np.int32)], [a[0:10], alone], [alone, a[0:10]]):
        assert joined(apart) is None


def test_message_runs_follow_the_plan_not_the_memory():
    specs = [GradSpec(DENSE, (300,), np.float32), GradSpec(DENSE, (300,), np.float32),
             GradSpec(DENSE, (300,), np.float32), GradSpec(DENSE, (300,), np.float64),
             GradSpec(DENSE, (300,), np.float64)]
    plan = make_plan(specs, bucket_bytes=1000)
    assert [b.dtype for b in plan.buckets] == [np.float32] * 3 + [np.float64] * 2
    assert message_runs(plan.buckets, set()) == ((0, 2), (3, 4))
    assert message_runs(plan.buckets, {1}) == ((0, 0), (1, 1), (2, 2), (3, 4))
    assert message_runs(plan.buckets, {0, 4}) == ((0, 0), (1, 2), (3, 3), (4, 4))


def test_bucket_buffers_of_one_dtype_lie_side_by_side():
    grads = [np.ones(300, np.float32), np.ones(300, np.float32), np.ones(300, np.float64)]
    plan = make_plan([GradSpec(DENSE, g.shape, g.dtype) for g in grads], bucket_bytes=1000)
    buffers = BucketBuffers(plan, [g.dtype for g in grads])
    assert len(buffers.arrays) == 3 and buffers.starts == [0, 300, 0]
    assert joined(buffers.arrays[:2]).size == 600


def test_holds_recognises_its_own_views():
    grads = [np.ones(3, np.float32), np.ones(2, np.float32)]
    buffers = buffers_for(grads)
    views = [v for _, v in buffers.views[0]]
    assert buffers.held(0, views) == 2 and buffers.held(0, grads) == 0
    assert buffers.held(0, [views[0], grads[1]]) == 1


@pytest.mark.parametrize("half", [np.float16, bfloat16])
def test_torch_accelerated_casts_are_bitwise_numpys(half):
    torch = pytest.importorskip("torch")     # imported: assign() now takes torch's kernels
    from mpigrad._base.dtypes import assign
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = bits.view(half)
    up, want_up = np.empty(values.shape, np.float32), np.empty(values.shape, np.float32)
    with np.errstate(invalid="ignore"):
        assign(up, values)
        want_up[...] = values
    nan = np.isnan(want_up)
    assert np.array_equal(up[~nan].view(np.uint32), want_up[~nan].view(np.uint32))
    assert np.isnan(up[nan]).all()
    rng = np.random.default_rng(0)
    wide = np.concatenate([rng.standard_normal(1 << 16).astype(np.float32) * 1e3,
                           (np.arange(1 << 16, dtype=np.uint32) << 13).view(np.float32),
                           np.array([np.inf, -np.inf, 7e4, 1e-8, -6e-8], np.float32)])
    down, want_down = np.empty(wide.shape, half), np.empty(wide.shape, half)
    with np.errstate(all="ignore"):
        assign(down, wide)
        want_down[...] = wide
    nan = np.isnan(wide)
    assert np.array_equal(down.view(np.uint16)[~nan], want_down.view(np.uint16)[~nan])
    assert np.isnan(down[nan].astype(np.float32)).all()
    assert torch is not None

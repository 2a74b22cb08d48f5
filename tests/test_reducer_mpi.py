"""Collective tests of the dense Reducer; run under mpiexec -n 2 and -n 3."""

import numpy as np
import pytest

from helpers import ALL_DTYPES, assert_bitwise_equal, assert_same_on_all_ranks, expected, pattern
from mpigrad import PeerError, Reducer
from mpigrad._base.dtypes import bfloat16

pytestmark = pytest.mark.mpi(min_size=2)

SHAPES = [(3, 5), (7,), (), (0,), (2, 0, 3), (4, 4, 2), (1,), (33,)]


def grads_for(comm, shapes, dtypes, seed=0):
    return [pattern(s, d, comm.rank, seed + i) for i, (s, d) in enumerate(zip(shapes, dtypes))]


def check(comm, out, shapes, dtypes, seed=0, mean=True, degree=None, skip=None, given=None):
    assert isinstance(out, list) and len(out) == len(shapes)
    for i, (s, d) in enumerate(zip(shapes, dtypes)):
        if skip is not None and skip[i]:
            assert out[i] is given[i]
            assert_bitwise_equal(out[i], pattern(s, d, comm.rank, seed + i), f"skipped {i}")
            continue
        want = expected(s, d, comm.size, seed + i, mean=mean, degree=degree)
        assert_bitwise_equal(out[i], want, f"grad {i} ({np.dtype(d).name}{s})")
    reduced = [o for i, o in enumerate(out) if skip is None or not skip[i]]
    assert_same_on_all_ranks(comm, reduced)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
def test_every_dtype_mean_and_sum(comm, dtype, mean):
    dtypes = [dtype] * len(SHAPES)
    grads = grads_for(comm, SHAPES, dtypes)
    with Reducer(comm, mean=mean) as reducer:
        out = reducer.reduce(grads)
    check(comm, out, SHAPES, dtypes, mean=mean)
    assert all(o is not g for o, g in zip(out, grads))
    for i, g in enumerate(grads):       # inputs untouched
        assert_bitwise_equal(g, pattern(SHAPES[i], dtype, comm.rank, i))


def test_mixed_dtypes_in_one_list(comm):
    shapes = SHAPES[:6] * 2
    dtypes = ALL_DTYPES * 2
    grads = grads_for(comm, shapes, dtypes, seed=3)
    with Reducer(comm) as reducer:
        out = reducer(grads)
        plan = reducer.plan(grads)
    check(comm, out, shapes, dtypes, seed=3)
    wire = sorted(b.dtype.name for b in plan.buckets)
    assert wire == ["complex128", "complex64", "float32", "float64"]


@pytest.mark.parametrize("degree", [1, 2, 5])
def test_explicit_degree(comm, degree):
    shapes = [(6,), (2, 2)]
    dtypes = [np.float32, np.float16]
    with Reducer(comm, degree=degree) as reducer:
        out = reducer.reduce(grads_for(comm, shapes, dtypes))
    check(comm, out, shapes, dtypes, degree=degree)


@pytest.mark.parametrize("split", [[1], [3], [1, 2, 3, 4, 5, 6, 7], [2, 6]])
def test_split_indices(comm, split):
    dtypes = [np.float32, np.float64, np.float16, bfloat16] * 2
    grads = grads_for(comm, SHAPES, dtypes)
    with Reducer(comm, split_indices=split) as reducer:
        out = reducer.reduce(grads)
        plan = reducer.plan(grads)
    check(comm, out, SHAPES, dtypes)
    assert max(b.group for b in plan.buckets) == len(split)


def test_tiny_bucket_bytes_one_bucket_per_gradient(comm):
    shapes = [s for s in SHAPES if np.prod(s) > 0]
    dtypes = [np.float32, np.float16] * 3
    grads = grads_for(comm, shapes, dtypes)
    with Reducer(comm, bucket_bytes=1, mean=False) as reducer:
        out = reducer.reduce(grads)
        assert [b.indices for b in reducer.plan(grads).buckets] == [(i,) for i in range(6)]
    check(comm, out, shapes, dtypes, mean=False)


def test_small_chunks_split_big_buckets(comm):
    shapes = [(1000,), (37,), (5, 5)]
    dtypes = [np.float64, np.float32, np.float16]
    with Reducer(comm, chunk_bytes=24) as reducer:
        out = reducer.reduce(grads_for(comm, shapes, dtypes))
    check(comm, out, shapes, dtypes)


def test_skip_mask(comm):
    dtypes = [np.float32, np.float16] * 4
    skip = [True, False, False, True, False, True, True, False]
    grads = grads_for(comm, SHAPES, dtypes)
    for inplace in (False, True):
        grads = grads_for(comm, SHAPES, dtypes)
        with Reducer(comm, skip=skip) as reducer:
            out = reducer.reduce(grads, inplace=inplace)
            plan = reducer.plan(grads)
        check(comm, out, SHAPES, dtypes, skip=skip, given=grads)
        assert plan.skipped == (0, 3, 5, 6)
        assert all(i not in b.indices for b in plan.buckets for i in plan.skipped)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16, np.complex128],
                         ids=lambda d: np.dtype(d).name)
def test_inplace_writes_into_callers_arrays(comm, dtype):
    dtypes = [dtype] * len(SHAPES)
    grads = grads_for(comm, SHAPES, dtypes)
    with Reducer(comm) as reducer:
        out = reducer.reduce(grads, inplace=True)
    assert all(o is g for o, g in zip(out, grads))
    check(comm, grads, SHAPES, dtypes)


def test_inplace_read_only_raises_before_writing(comm):
    grads = grads_for(comm, [(4,), (3,)], [np.float32, np.float32])
    grads[1].flags.writeable = False
    with Reducer(comm) as reducer:
        with pytest.raises(ValueError, match=r"grads\[1\].*read-only"):
            reducer.reduce(grads, inplace=True)
    assert_bitwise_equal(grads[0], pattern((4,), np.float32, comm.rank, 0))


@pytest.mark.parametrize("settings", [{}, {"bucket_bytes": 1024}, {"cross_memory": False},
                                      {"reproducible": True}, {"skip": [False, True] * 4}],
                         ids=["default", "small-buckets", "mpi", "reproducible", "skip"])
def test_out_gives_the_arrays_the_results_are_written_into(comm, settings):
    """reduce(grads, out=arrays): the plain reduce's bits, written into the given
    arrays (returned, in the gradients' structure), the gradients untouched; the
    big gradients' buckets summed straight into theirs, a Fortran-ordered one
    unpacked; a skipped gradient copied there as it came."""
    shapes = [(64, 32), (7,), (3, 5), (33,), (40, 40), (2, 0, 3), (1,), (300,)]
    dtypes = [np.float32, np.float16, bfloat16, np.float64, np.float32, np.float32,
              np.complex64, np.float16]
    grads = grads_for(comm, shapes, dtypes, seed=5)
    grads[4] = np.asfortranarray(grads[4])
    tree = {"params": grads}
    with Reducer(comm, **settings) as reducer:
        want = reducer.reduce(tree)["params"]
        for _ in range(2):                  # a second call: the plan and buffers kept
            outs = [np.full(s, 7, d) for s, d in zip(shapes, dtypes)]
            got = reducer.reduce(tree, out={"params": outs})
            assert all(a is b for a, b in zip(got["params"], outs))
            for i, (a, b) in enumerate(zip(outs, want)):
                assert_bitwise_equal(a, b, f"out[{i}]")
    if "skip" not in settings:                   # (skipped ones: the plain reduce's, above)
        check(comm, outs, shapes, dtypes, seed=5)
    for i, g in enumerate(grads):                # the gradients untouched
        assert_bitwise_equal(g, pattern(shapes[i], dtypes[i], comm.rank, 5 + i))


@pytest.mark.parametrize("cross_memory", ["auto", False], ids=["auto", "mpi"])
def test_out_arrays_apart_get_their_own_part_of_a_shared_bucket(comm, cross_memory):
    """Buckets of several gradients of one dtype, each bucket's results written into
    ``out`` arrays that lie apart (a compiled step's buffers): every array its own
    part, in float32, float64 and complex64."""
    shapes = [(3, 4), (5,), (2, 3, 2), (1,), (6,), (4, 4)]
    dtypes = [np.float32, np.float32, np.float64, np.float64, np.complex64, np.complex64]
    grads = grads_for(comm, shapes, dtypes, seed=3)
    with Reducer(comm, mean=False, cross_memory=cross_memory) as reducer:
        for _ in range(2):
            outs = [np.full(s, 7, d) for s, d in zip(shapes, dtypes)]
            reducer.reduce(grads, out=outs)
            check(comm, outs, shapes, dtypes, seed=3, mean=False)


def test_out_is_checked_on_every_rank_before_anything_is_written(comm):
    grads = grads_for(comm, [(4,), (3, 2)], [np.float32, np.float16])
    good = [np.zeros(4, np.float32), np.zeros((3, 2), np.float16)]
    with Reducer(comm) as reducer:
        wrong = {0: [np.zeros(5, np.float32), good[1]],
                 1: [good[0], np.zeros((3, 2), np.float32)],
                 2: [good[0], grads[1]]}            # the gradient itself
        for case, (error, match) in {0: (ValueError, r"out\[0\]: expecting the gradient's "
                                                      r"float32 \(4,\), got float32 \(5,\)"),
                                     1: (ValueError, r"out\[1\]: expecting the gradient's float16"),
                                     2: (ValueError, r"out\[1\] and grads\[1\] share memory")}.items():
            mine = wrong[case] if comm.rank == comm.size - 1 else [o.copy() for o in good]
            expect = error if comm.rank == comm.size - 1 or comm.size == 1 else PeerError
            with pytest.raises(expect, match=match if expect is error else None):
                reducer.reduce(grads, out=mine)
        read_only = [good[0].copy(), good[1].copy()]
        read_only[0].flags.writeable = False
        with pytest.raises(ValueError, match=r"out\[0\]: expecting a writeable array"):
            reducer.reduce(grads, out=read_only)
        with pytest.raises(ValueError, match="inplace=True"):
            reducer.reduce(grads, inplace=True, out=good)
        out = reducer.reduce(grads, out=good)       # and it goes on
    check(comm, out, [(4,), (3, 2)], [np.float32, np.float16])


@pytest.mark.parametrize("cross_memory", ["auto", False], ids=["auto", "mpi"])
def test_out_takes_gradients_that_share_memory(comm, cross_memory):
    """Gradients are only read by a reduce into ``out=`` arrays: the same array twice
    (XLA hands one buffer for equal operands: a compiled step's zero gradients) and
    overlapping views reduce as their copies would, in float32 and float16; two
    outputs sharing memory are still refused, on every rank."""
    a = pattern((12,), np.float32, comm.rank, 1)
    h = pattern((6,), np.float16, comm.rank, 2)
    grads = [a, pattern((3,), np.float32, comm.rank, 3), a, a[2:8], h, h, h[1:4]]
    with Reducer(comm, mean=False, cross_memory=cross_memory) as reducer:
        want = reducer.reduce([g.copy() for g in grads])
        for _ in range(2):
            outs = [np.full(g.shape, 7, g.dtype) for g in grads]
            reducer.reduce(grads, out=outs)
            for i, (got, ref) in enumerate(zip(outs, want)):
                assert_bitwise_equal(got, ref, f"out[{i}]")
        shared = np.zeros(12, np.float32)
        mine = [shared, outs[1], shared if comm.rank == comm.size - 1 else outs[2]] + outs[3:]
        expect = ValueError if comm.rank == comm.size - 1 or comm.size == 1 else PeerError
        with pytest.raises(expect):
            reducer.reduce(grads, out=mine)
    assert_bitwise_equal(a, pattern((12,), np.float32, comm.rank, 1))      # only read
    assert_bitwise_equal(h, pattern((6,), np.float16, comm.rank, 2))


def test_memory_order_and_strided_views(comm):
    base = [pattern((6, 8), np.float32, comm.rank, 0), pattern((5, 4, 3), np.float16, comm.rank, 1)]
    # the same logical values on every rank, laid out differently per rank
    fortran = np.asfortranarray(base[0]) if comm.rank % 2 == 0 else base[0].copy()
    big = np.zeros((10, 8, 6), np.float16)
    big[::2, ::2, ::2] = base[1]
    strided = big[::2, ::2, ::2]
    with Reducer(comm) as reducer:
        out = reducer.reduce([fortran, strided])
        assert out[0].flags.f_contiguous == fortran.flags.f_contiguous
        assert_bitwise_equal(out[0], expected((6, 8), np.float32, comm.size, 0))
        assert_bitwise_equal(out[1], expected((5, 4, 3), np.float16, comm.size, 1))
        reducer.reduce([fortran, strided], inplace=True)
    assert_bitwise_equal(fortran, expected((6, 8), np.float32, comm.size, 0))
    assert_bitwise_equal(strided, expected((5, 4, 3), np.float16, comm.size, 1))
    assert not big[1::2].any()          # nothing written outside the view


def test_buffers_reused_across_calls(comm):
    shapes = [(16,), (3, 3)]
    dtypes = [np.float32, np.float16]
    with Reducer(comm, mean=False) as reducer:
        memory = reducer.bucket_views(grads_for(comm, shapes, dtypes))[0]
        first = reducer.reduce(grads_for(comm, shapes, dtypes))
        for _ in range(3):
            again = reducer.reduce(grads_for(comm, shapes, dtypes))
        # the same signature keeps its bucket memory
        assert reducer.bucket_views(grads_for(comm, shapes, dtypes))[0].base is memory.base
    check(comm, first, shapes, dtypes, mean=False)
    check(comm, again, shapes, dtypes, mean=False)


def test_tuple_input_and_empty_list(comm):
    with Reducer(comm) as reducer:
        assert reducer.reduce([]) == []
        out = reducer.reduce(tuple(grads_for(comm, [(2,)], [np.float64])))
    check(comm, out, [(2,)], [np.float64])


def test_communicator_is_duplicated_and_freed(comm):
    from mpi4py import MPI
    reducer = Reducer(comm)
    assert MPI.Comm.Compare(reducer.comm, comm) == MPI.CONGRUENT
    reducer.free()
    reducer.free()
    assert reducer.comm == MPI.COMM_NULL


def test_broadcast(comm):
    import mpigrad
    arrays = [np.full((3, 2), comm.rank, np.float32), np.asfortranarray(
        np.arange(6.0).reshape(2, 3) + comm.rank)]
    mpigrad.broadcast(arrays, root=comm.size - 1, comm=comm)
    assert (arrays[0] == comm.size - 1).all()
    assert np.array_equal(arrays[1], np.arange(6.0).reshape(2, 3) + comm.size - 1)


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "copy"])
def test_bucket_views_zero_copy(comm, inplace):
    shapes = [(3, 4), (5,), (), (2, 2), (6,)]
    dtypes = [np.float32, np.float16, np.float64, np.complex64, np.float32]
    like = grads_for(comm, shapes, dtypes)
    with Reducer(comm, bucket_bytes=64) as reducer:
        views = reducer.bucket_views(like)
        for i, (v, g) in enumerate(zip(views, like)):
            if g.dtype == np.float16:
                assert v is g                       # half precision cannot be a view
            else:
                assert v is not g and v.base is not None and v.flags.c_contiguous
                v[...] = g                          # the trainer writes its gradients
        for step in range(2):
            if step:
                for v, g in zip(views, like):
                    v[...] = g
            out = reducer.reduce(views, inplace=inplace)
            check(comm, out, shapes, dtypes)
            if inplace:
                assert all(o is v for o, v in zip(out, views))
            else:                                   # inputs untouched
                for v, g in zip(views, like):
                    assert_bitwise_equal(v, g)


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "copy"])
def test_big_gradients_reduced_in_their_own_memory(comm, inplace):
    shapes = [(64, 32), (64, 32), (8,)]
    dtypes = [np.float32, np.float32, np.float32]
    grads = grads_for(comm, shapes, dtypes)
    grads[1] = np.asfortranarray(grads[1])          # not C-contiguous: packed instead
    originals = [g.copy() for g in grads]
    with Reducer(comm, bucket_bytes=1024, chunk_bytes=1000) as reducer:
        assert [b.indices for b in reducer.plan(grads).buckets] == [(0,), (1,), (2,)]
        out = reducer.reduce(grads, inplace=inplace)
    check(comm, out, shapes, dtypes)
    if not inplace:
        for g, o in zip(grads, originals):
            assert_bitwise_equal(g, o)


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "copy"])
def test_verify_with_partly_zero_copy_bucket(comm, inplace):
    shapes, dtypes = [(4,), (3,)], [np.float32, np.float16]
    like = grads_for(comm, shapes, dtypes)
    with Reducer(comm, verify=True) as reducer:
        views = reducer.bucket_views(like)
        views[0][...] = like[0]
        out = reducer.reduce(views, inplace=inplace)
    check(comm, out, shapes, dtypes)
    if not inplace:
        assert_bitwise_equal(views[0], like[0])


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "copy"])
@pytest.mark.parametrize("shared_memory", ["auto", False], ids=["auto", "mpi"])
def test_memory_layouts_that_differ_across_ranks(comm, inplace, shared_memory):
    # the last rank's gradients are Fortran-ordered, some of them views of
    # its bucket memory: its buckets lie elsewhere than the other ranks'
    # (packed where theirs are summed in place, apart where theirs lie back
    # to back), but every rank must send the same messages
    shapes = [(32, 32)] * 6
    dtypes = [np.float32] * 4 + [np.float64] * 2
    with Reducer(comm, bucket_bytes=4096, shared_memory=shared_memory) as reducer:
        for _ in range(2):
            grads = grads_for(comm, shapes, dtypes)
            if comm.rank == comm.size - 1:
                grads[1:3] = [np.asfortranarray(g) for g in grads[1:3]]
                grads[5] = np.asfortranarray(grads[5])
                if inplace:
                    views = reducer.bucket_views(grads)
                    views[3][...] = grads[3]
                    grads[3] = views[3]
            elif inplace:
                reducer.bucket_views(grads)        # collective with node memory
            out = reducer.reduce(grads, inplace=inplace)
            check(comm, out, shapes, dtypes)


@pytest.mark.parametrize("calls", [("reduce", "reduce_inplace"), ("reduce_inplace", "start"),
                                   ("reduce", "start")])
def test_different_calls_on_different_ranks_raise_on_every_rank(comm, calls):
    if comm.size == 1:
        pytest.skip("a communicator of size 1 has no other rank")
    grads = grads_for(comm, [(32, 32)] * 4, [np.float32] * 4)
    call = calls[comm.rank == comm.size - 1]
    with Reducer(comm, bucket_bytes=4096, timeout=30) as reducer:
        with pytest.raises(ValueError, match="expecting the same call on every rank"):
            if call == "start":
                reducer.start(grads).wait()
            else:
                reducer.reduce(grads, inplace=call == "reduce_inplace")
        check(comm, reducer.reduce(grads), [(32, 32)] * 4, [np.float32] * 4)

"""Node-shared buckets (shared_memory=): results against the numpy reference and
bitwise across ranks beside sparse gradients and with the finite check, which
calls "auto" sums in node memory, errors on every rank where True cannot be
had, and no segment left behind. Run under mpiexec -n 2 and -n 3 (and at 4
ranks as 2 nodes of 2 with MPIGRAD_NODE_SIZE=2)."""

import gc
import glob
import os
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mpigrad._backends.cross_memory
import mpigrad._engine.choice
import mpigrad._backends.node_memory
import mpigrad._backends.select

from helpers import (ALL_DTYPES, assert_bitwise_equal, assert_same_on_all_ranks, expected,
                     pattern, recording, sparse_rows, watching)
from mpigrad import PeerError, Reducer, RowSparse
from mpigrad._base.dtypes import bfloat16

pytestmark = pytest.mark.mpi(min_size=2)

SHAPES = [(40, 30), (7,), (), (1000,), (3, 3)]


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def last(comm):
    return comm.rank == comm.size - 1


# the two node sums: in the shared buckets (segments), and through
# cross-memory attach for calls not zero-copy everywhere
NODE_SUMS = {"segments": {"shared_memory": True, "cross_memory": False},
             "cross-memory": {"cross_memory": True}}


@pytest.fixture(params=list(NODE_SUMS))
def node(request, comm):
    try:
        Reducer(comm, **NODE_SUMS[request.param]).free()
    except RuntimeError as exc:         # on every rank alike
        pytest.skip(str(exc))
    return NODE_SUMS[request.param]


def cross_memory_reducer(comm, **settings):
    """A Reducer whose sums go through cross-memory attach, or the test skipped where
    the kernel refuses it (on every rank alike)."""
    try:
        return Reducer(comm, cross_memory=True, **settings)
    except RuntimeError as exc:
        pytest.skip(str(exc))


def grads_of(comm, dtype, seed=0):
    return [pattern(s, dtype, comm.rank, seed + i) for i, s in enumerate(SHAPES)]


def check(comm, out, dtype, mean, seed=0):
    for i, s in enumerate(SHAPES):
        assert_bitwise_equal(out[i], expected(s, dtype, comm.size, seed + i, mean=mean),
                             f"grad {i}")
    assert_same_on_all_ranks(comm, out)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
def test_every_path_in_node_memory(comm, node, dtype, mean):
    with Reducer(comm, mean=mean, **node, bucket_bytes=2000) as reducer:
        assert reducer.uses_shared_memory
        check(comm, reducer.reduce(grads_of(comm, dtype)), dtype, mean)
        assert reducer.backend == ("cross-memory" if reducer.uses_cross_memory
                                   else "node memory")
        grads = grads_of(comm, dtype)
        check(comm, reducer.reduce(grads, inplace=True), dtype, mean)
        check(comm, grads, dtype, mean)
        views = reducer.bucket_views(grads_of(comm, dtype))
        for view, grad in zip(views, grads_of(comm, dtype)):
            view[...] = grad
        for _ in range(3):               # the same segments call after call
            for view, grad in zip(views, grads_of(comm, dtype)):
                if view.dtype == dtype:
                    view[...] = grad
            out = reducer.reduce(views, inplace=True)
            check(comm, out, dtype, mean)
        handle = reducer.start(grads_of(comm, dtype))
        for i in reversed(range(len(SHAPES))):
            handle.ready(i)
        check(comm, handle.wait(), dtype, mean)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
def test_half_precision_in_place_moves_half_the_bytes_of_float32(comm, dtype, mean):
    """reduce(inplace=True) of float16/bfloat16 gradients through cross-memory:
    summed in half-precision memory (a gradient's own where it fills its bucket
    alone, Fortran-ordered ones and shared buckets staged side by side in half
    precision), in float32 and rounded once: the bits from the rank count, the
    plain reduce's, and half the bytes a float32 call of the same shapes moves."""
    import mpigrad
    reducer = cross_memory_reducer(comm, mean=mean, bucket_bytes=8000)

    def grads(kind):
        out = grads_of(comm, kind)
        out[0] = np.asfortranarray(out[0])          # (40, 30) fills a bucket alone
        return out

    with reducer:
        moved = {}
        for kind in (np.float32, dtype):
            reducer.reduce(grads(kind), inplace=True)          # plans made, measured
            mine = grads(kind)
            before = mpigrad.statistics()
            out = reducer.reduce(mine, inplace=True)
            moved[kind] = (mpigrad.statistics() - before).moved
            assert reducer.backend == "cross-memory"
            assert all(o is g for o, g in zip(out, mine)) and mine[0].flags.f_contiguous
            check(comm, out, kind, mean)
        assert_same_on_all_ranks(comm, out + reducer.reduce(grads(dtype)))
    float32_data = sum(np.prod(s, dtype=int) for s in SHAPES) * 4
    assert moved[dtype] < moved[np.float32] - 0.4 * float32_data * (comm.size - 1) / comm.size


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_gradients_across_the_slices_of_two_ranks(comm, node, dtype):
    # one bucket: the local ranks' slices cut through gradients, whose values
    # are then read from two segments; Fortran-ordered gradients (and results)
    # go through the non-contiguous paths
    with Reducer(comm, **node) as reducer:
        for order in "CF":
            grads = [np.asarray(g, order=order) for g in grads_of(comm, dtype)]
            out = reducer.reduce(grads)
            check(comm, out, dtype, True)
            assert all(o.flags.f_contiguous for o in out if o.ndim > 1) == (order == "F")
            check(comm, reducer.reduce(grads, inplace=True), dtype, True)
            check(comm, grads, dtype, True)


def test_calls_back_to_back_with_ranks_out_of_step(comm, node):
    # no barrier ends a call: a rank may write its buckets for the next call
    # (views or packing) while another still reads the last results
    import time
    rng = np.random.default_rng(comm.rank)
    results = []
    with Reducer(comm, **node, bucket_bytes=2000) as reducer:
        views = reducer.bucket_views(grads_of(comm, np.float32))
        for step in range(40):
            grads = grads_of(comm, np.float32, seed=step)
            time.sleep(rng.uniform(0, 0.002))
            if step % 2:
                for view, grad in zip(views, grads):
                    view[...] = grad
                out = reducer.reduce(views, inplace=True)
            else:
                out = reducer.reduce(grads)
            results.append([o.copy() for o in out])
            time.sleep(rng.uniform(0, 0.002))
    for step, out in enumerate(results):      # no other collective between the calls
        check(comm, out, np.float32, True, seed=step)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=lambda d: d.__name__)
def test_gradients_side_by_side_on_some_ranks_and_apart_on_others(comm, dtype):
    """In place through cross-memory, gradients that each fill a bucket and lie back
    to back in one array on the first two ranks (the second continuing the first,
    the fourth the second) and apart elsewhere: each rank's runs of neighbours are
    joined only where every rank has the same (at 4 ranks as 2 nodes of 2, the
    nodes differ: a run joined on one node alone hung until the watchdog)."""
    reducer = cross_memory_reducer(comm, mean=False, bucket_bytes=1000)
    shapes = [(600,), (50, 12), (700,), (3, 200)]
    with reducer:
        for seed in range(3):
            values = [pattern(s, dtype, comm.rank, seed + i) for i, s in enumerate(shapes)]
            if comm.rank < 2:         # memory: [0 | 1 | 3], 2 apart
                flat = np.empty(3 * 600, dtype)
                grads = [flat[:600], flat[600:1200].reshape(50, 12), np.empty(700, dtype),
                         flat[1200:].reshape(3, 200)]
            else:
                grads = [np.empty(s, dtype) for s in shapes]
            for grad, value in zip(grads, values):
                grad[...] = value
            out = reducer.reduce(grads, inplace=True)
            assert reducer.backend == "cross-memory"
            assert all(o is g for o, g in zip(out, grads))
            for i, s in enumerate(shapes):
                assert_bitwise_equal(out[i], expected(s, dtype, comm.size, seed + i, mean=False),
                                     f"grad {i}")
            assert_same_on_all_ranks(comm, out)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("given", [False, True], ids=["new", "out"])
def test_half_precision_results_in_another_memory_order_on_one_rank(comm, dtype, given):
    """A plain cross-memory reduce of half-precision gradients whose results cannot lie
    back to back on the last rank alone (its gradients, or its out= arrays, in Fortran
    order): every rank still sums the bucket in half precision (the last in staging),
    where the ranks' memory of it differed in size and the call raised."""
    reducer = cross_memory_reducer(comm, mean=True, bucket_bytes=2000)
    odd = "F" if last(comm) else "C"
    with reducer:
        for _ in range(2):
            grads = grads_of(comm, dtype)
            if given:
                out = [np.empty(g.shape, g.dtype, order=odd) for g in grads]
                result = reducer.reduce(grads, out=out)
                assert all(r is o for r, o in zip(result, out))
            else:
                result = reducer.reduce([np.asarray(g, order=odd) for g in grads])
            assert reducer.backend == "cross-memory"
            check(comm, result, dtype, True)


@st.composite
def layouts(draw):
    """A call and its gradients' shapes and dtype; each rank lays them out its own way."""
    shapes = draw(st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=2).map(tuple),
                           min_size=2, max_size=6))
    if draw(st.booleans()):
        shapes[0] = (70_000,)          # a bucket of its own, sliced across the ranks
    return {"shapes": shapes, "dtype": draw(st.sampled_from(ALL_DTYPES)),
            "mean": draw(st.booleans()), "seed": draw(st.integers(0, 2**16)),
            "call": draw(st.sampled_from(["plain", "inplace", "out", "start", "scatter"])),
            "settings": draw(st.sampled_from([{}, {"cross_memory": True},
                                              {"bucket_bytes": 600},
                                              {"bucket_bytes": 600, "cross_memory": True}]))}


def laid_out(shapes, dtype, rng):
    """Arrays of ``shapes`` as one rank lays them out: apart (some in Fortran order), or
    back to back in one array in some order from some offset."""
    if rng.random() < 0.4:
        return [np.empty(s, dtype, order="F" if rng.random() < 0.4 else "C") for s in shapes]
    sizes = [int(np.prod(s)) for s in shapes]
    at = int(rng.integers(0, 3))
    flat, arrays = np.empty(sum(sizes) + at, dtype), [None] * len(shapes)
    for k in (rng.permutation(len(shapes)) if rng.random() < 0.5 else range(len(shapes))):
        arrays[k] = flat[at:at + sizes[k]].reshape(shapes[k])
        at += sizes[k]
    return arrays


@settings(max_examples=30, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(case=layouts())
def test_any_memory_layout_on_any_rank_gives_the_reference(case):
    """The same gradients laid out differently on every rank (and on every node): the
    reference's bits on every rank, for each kind of call (a reduce-scatter through its
    shards gathered back into arrays laid out anew). Every rank passes or fails
    each example together (one allgather of the verdicts)."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    case = comm.bcast(case)
    rng = np.random.default_rng((case["seed"], comm.rank))
    shapes, dtype, mean = case["shapes"], case["dtype"], case["mean"]
    found = []
    try:
        with Reducer(comm, mean=mean, **case["settings"]) as reducer:
            for _ in range(2):
                grads = laid_out(shapes, dtype, rng)
                for i, (grad, shape) in enumerate(zip(grads, shapes)):
                    grad[...] = pattern(shape, dtype, comm.rank, i)
                if case["call"] == "plain":
                    out = reducer.reduce(grads)
                elif case["call"] == "inplace":
                    out = reducer.reduce(grads, inplace=True)
                elif case["call"] == "out":
                    out = reducer.reduce(grads, out=laid_out(shapes, dtype, rng))
                elif case["call"] == "scatter":        # each rank's shard, gathered back
                    out = reducer.allgather_shards(reducer.reduce_scatter(grads),
                                                   laid_out(shapes, dtype, rng))
                else:
                    handle = reducer.start(grads)
                    for k in rng.permutation(len(grads)):
                        handle.ready(int(k))
                    out = handle.wait()
                found += [f"grad {i} differs" for i, (o, shape) in enumerate(zip(out, shapes))
                          if o.shape != shape or o.tobytes("C") != expected(
                              shape, dtype, comm.size, i, mean=mean).tobytes("C")]
    except Exception as exc:                 # noqa: BLE001  (reported on every rank)
        found = [f"raised {type(exc).__name__}: {exc}"]
        # said at once too: where a peer is still inside the call, the allgather below
        # stalls until the watchdog aborts the job, and this would not be seen
        print(f"rank {comm.rank}, {case}: {found[0]}", file=sys.__stderr__, flush=True)
    failed = [(r, f) for r, f in enumerate(comm.allgather(found)) if f]
    assert not failed, failed


def test_sparse_skip_and_split_beside_node_memory(comm, node):
    dense = [pattern((50, 4), np.float32, comm.rank, 0), pattern((9,), np.float16, comm.rank, 1)]
    indices, values = sparse_rows(comm.rank, 2, 30, 3 + comm.rank, (4,), np.float32)
    grads = [dense[0], RowSparse(indices, values, (30, 4)), dense[1],
             pattern((6,), np.float32, comm.rank, 3)]
    with Reducer(comm, **node, skip=[False, False, False, True],
                 split_indices=[1]) as reducer:
        out = reducer.reduce(grads)
    assert_bitwise_equal(out[0], expected((50, 4), np.float32, comm.size, 0))
    assert_bitwise_equal(out[2], expected((9,), np.float16, comm.size, 1))
    assert out[3] is grads[3]
    rows = [sparse_rows(r, 2, 30, 3 + r, (4,), np.float32) for r in range(comm.size)]
    want = np.zeros((30, 4), np.float32)
    for idx, val in rows:
        np.add.at(want, idx, val)
    assert np.allclose(out[1].to_dense(), want / comm.size, rtol=1e-6, atol=1e-6)
    assert_same_on_all_ranks(comm, [out[0], out[2], out[1].to_dense()])


def test_finite_flag_is_the_same_on_every_rank(comm, node):
    with Reducer(comm, **node, check_finite=True, mean=False) as reducer:
        grads = [np.ones(1000, np.float32), np.full(10, 40000.0, np.float16)]
        reducer.reduce(grads)
        assert reducer.finite is False           # 40000 * ranks overflows float16
        grads = [np.ones(1000, np.float32), np.ones(10, np.float16)]
        if last(comm):
            grads[0][999] = np.inf               # one value on one rank, in its slice or not
        reducer.reduce(grads)
        assert reducer.finite is False
        reducer.reduce([np.ones(1000, np.float32), np.ones(10, np.float16)])
        assert reducer.finite is True


def grads_of_300(comm):
    return [pattern((300,), np.float32, comm.rank, i) for i in range(3)]


@pytest.mark.parametrize("where", range(5))
def test_mean_and_finite_check_cover_every_bucket_of_a_piece(comm, node, where):
    # five buckets of two wire dtypes' limits in one summed piece: each is
    # scaled, and a non-finite value in any of them is seen
    shapes = [(300,), (10,), (300,), (10,), (300,)]
    dtypes = [np.float32, np.float16, np.float32, np.float16, np.float32]
    with Reducer(comm, **node, check_finite=True, bucket_bytes=1200) as reducer:
        grads = [pattern(s, d, comm.rank, i) for i, (s, d) in enumerate(zip(shapes, dtypes))]
        out = reducer.reduce(grads)
        assert reducer.finite is True
        for i, (s, d) in enumerate(zip(shapes, dtypes)):
            assert_bitwise_equal(out[i], expected(s, d, comm.size, i), f"grad {i}")
        if last(comm):
            grads[where][-1] = np.inf
        reducer.reduce(grads)
        assert reducer.finite is False


def test_without_cross_memory_auto_sums_zero_copy_and_plain_calls_in_node_memory_and_packed_ones_where_it_pays(  # noqa: E501
        comm, monkeypatch):
    from mpi4py import MPI
    packed_through_mpi = "MPICH" in MPI.Get_library_version()     # see NodeGroups.packing_pays
    skip_unless_one_host(comm)
    monkeypatch.setenv("MPIGRAD_NODE_SIZE", str(comm.size))     # one node of every rank
    wrapped, log = recording(comm)
    grads = grads_of_300(comm)
    with Reducer(wrapped, cross_memory=False) as reducer:
        assert reducer.shared_memory == "auto" and reducer.uses_shared_memory
        views = reducer.bucket_views(grads)
        for v, g in zip(views, grads):
            v[...] = g
        del log[:]
        reducer.reduce(views, inplace=True)
        zero_copy = [a for name, a in log if name == "Allreduce" and a.dtype == np.float32]
        out = reducer.reduce(grads)         # views handed out: through MPI, they stay
        with_views = [a for name, a in log if name == "Allreduce" and a.dtype == np.float32]
        for i, v in enumerate(views):
            assert_bitwise_equal(v, expected((300,), np.float32, comm.size, i))
        reducer.reduce(grads, inplace=True)
        packed = [a for name, a in log if name == "Allreduce" and a.dtype == np.float32]
    with Reducer(wrapped, cross_memory=False) as reducer:   # no views: plain, in node memory
        del log[:]
        plain = reducer.reduce(grads_of_300(comm))
        assert [a for name, a in log if name == "Allreduce" and a.dtype == np.float32] == []
    assert zero_copy == [] and len(with_views) == 1
    assert len(packed) == (2 if packed_through_mpi else 1)
    for i, (v, o, p, g) in enumerate(zip(views, out, plain, grads)):
        for array in (v, o, p, g):
            assert_bitwise_equal(array, expected((300,), np.float32, comm.size, i))


def test_auto_is_off_with_one_rank_per_node(comm, monkeypatch):
    monkeypatch.setenv("MPIGRAD_NODE_SIZE", "1")    # nothing to share: MPI's Allreduce
    with Reducer(comm) as auto, Reducer(comm, shared_memory=True) as forced:
        assert not auto.uses_shared_memory and forced.uses_shared_memory
        grads = grads_of(comm, np.float32)
        check(comm, auto.reduce(grads), np.float32, True)
        check(comm, forced.reduce(grads), np.float32, True)


@pytest.mark.parametrize("kwargs, match", [
    ({"shared_memory": True, "check": False}, "needs check=True"),
    ({"shared_memory": True, "verify": True}, "cannot be combined with verify"),
    ({"shared_memory": 1}, "expecting 'auto', True or False, got 1"),
    ({"shared_memory": "yes"}, "expecting 'auto', True or False"),
])
def test_bad_settings_raise_on_every_rank(comm, kwargs, match):
    if last(comm):
        with pytest.raises(ValueError, match=match):
            Reducer(comm, **kwargs)
    else:                                  # good settings here: the bad rank is named
        with pytest.raises(PeerError, match=match):
            Reducer(comm)


def test_true_where_one_rank_cannot_share_raises_on_every_rank(comm, monkeypatch):
    if last(comm):
        monkeypatch.setattr(mpigrad._backends.select, "shared_memory_problem",
                            lambda: "no /dev/shm here")
    with pytest.raises(RuntimeError, match=rf"rank {comm.size - 1}: no /dev/shm here"):
        Reducer(comm, shared_memory=True)
    with Reducer(comm) as reducer:              # "auto": MPI's Allreduce instead
        assert not reducer.uses_shared_memory
        check(comm, reducer.reduce(grads_of(comm, np.float32)), np.float32, True)


def assert_auto_falls_back_to_mpi(comm):
    with Reducer(comm) as reducer:
        views = reducer.bucket_views(grads_of(comm, np.float32))
        for view, grad in zip(views, grads_of(comm, np.float32)):
            view[...] = grad
        check(comm, reducer.reduce(views, inplace=True), np.float32, True)


def test_a_full_segment_directory_raises_with_true_and_falls_back_with_auto(comm, monkeypatch):
    if last(comm):
        monkeypatch.setattr(mpigrad._backends.node_memory, "_create", lambda nbytes: (None, "no room"))
    with Reducer(comm, shared_memory=True) as reducer:
        with pytest.raises(RuntimeError, match="no room"):
            reducer.reduce(grads_of(comm, np.float32))
    assert_auto_falls_back_to_mpi(comm)


def _mapped_segments():
    with open("/proc/self/maps") as maps:
        return sum("/mpigrad-" in line for line in maps)


def test_segments_are_unlinked_at_once_and_unmapped_when_freed(comm):
    grads = [np.ones(100, np.float32)]
    gc.collect()
    before = _mapped_segments()
    for _ in range(200):       # one mapping or file kept per Reducer would show
        with Reducer(comm, shared_memory=True) as reducer:
            reducer.reduce(grads)
    gc.collect()
    assert _mapped_segments() == before
    assert glob.glob(os.path.join(mpigrad._backends.node_memory.SEGMENT_DIR, f"mpigrad-{os.getpid()}-*")) == []


def skip_unless_one_host(comm):
    """Skip, on every rank together, where ``comm``'s ranks are on more than one host (a
    cluster): MPIGRAD_NODE_SIZE only cuts a host's ranks into smaller nodes."""
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    spans = comm.allreduce(node.Get_size() < comm.Get_size(), MPI.LOR)
    node.Free()
    if spans:
        pytest.skip("needs every rank on one host; these ranks span hosts")


def ranks_per_node(comm):
    from mpi4py import MPI
    if os.environ.get("MPIGRAD_NODE_SIZE"):
        return int(os.environ["MPIGRAD_NODE_SIZE"])
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    size = node.Get_size()
    node.Free()
    return size


def test_a_segment_one_rank_cannot_map_raises_with_true_and_falls_back_with_auto(comm, monkeypatch):
    if ranks_per_node(comm) == 1:         # MPICH over tcp: nothing of a peer's is mapped
        pytest.skip("one rank per node: no rank maps another's segment")
    if last(comm):        # as when this rank is out of file descriptors
        monkeypatch.setattr(mpigrad._backends.node_memory, "_map",
                            lambda path, nbytes: (None, f"cannot map {path}: [Errno 24] "
                                                        "Too many open files"))
    with Reducer(comm, shared_memory=True) as reducer:
        with pytest.raises(RuntimeError, match=r"rank \d: cannot map .*Too many open files"):
            reducer.reduce(grads_of(comm, np.float32))
    assert_auto_falls_back_to_mpi(comm)
    assert glob.glob(os.path.join(mpigrad._backends.node_memory.SEGMENT_DIR,
                                  f"mpigrad-{os.getpid()}-*")) == []


def test_a_new_signature_per_call_keeps_no_descriptor_per_mapping(comm):
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    with Reducer(comm, shared_memory=True) as reducer:
        for n in range(1, 301):
            out = reducer.reduce([pattern((n,), np.float32, comm.rank, 0)])
            assert_bitwise_equal(out[0], expected((n,), np.float32, comm.size, 0))
        assert _mapped_segments() >= 300 * ranks_per_node(comm)   # every plan's node memory
        assert len(os.listdir("/proc/self/fd")) < before + 10


def test_auto_sums_through_cross_memory_unless_every_rank_is_zero_copy(comm, monkeypatch):
    skip_unless_one_host(comm)
    monkeypatch.setenv("MPIGRAD_NODE_SIZE", str(comm.size))     # one node of every rank
    wrapped, log = recording(comm)
    grads = grads_of_300(comm)
    with Reducer(wrapped) as reducer:
        if not reducer.uses_cross_memory:
            pytest.skip("cross-memory attach is refused here")
        views = reducer.bucket_views(grads)
        for v, g in zip(views, grads):
            v[...] = g
        calls = {"zero-copy": lambda: reducer.reduce(views, inplace=True),
                 "plain": lambda: reducer.reduce(grads),
                 "in place": lambda: reducer.reduce(grads, inplace=True),
                 "overlapped": lambda: reducer.start(grads).wait()}
        backends, messages = {}, {}
        for name, call in calls.items():
            del log[:]
            out = call()
            backends[name] = reducer.backend
            messages[name] = len([a for n, a in log if n == "Allreduce" and a.dtype == np.float32])
            for i, o in enumerate(out):
                assert_bitwise_equal(o, expected((300,), np.float32, comm.size, i))
            for g, fresh in zip(grads, grads_of_300(comm)):
                g[...] = fresh
    # overlapped calls keep the rule before cross-memory: packed into the
    # shared buckets where that pays (not with MPICH: NodeGroups.packing_pays)
    from mpi4py import MPI
    packed_through_mpi = "MPICH" in MPI.Get_library_version()
    assert backends == {"zero-copy": "node memory", "plain": "cross-memory",
                        "in place": "cross-memory",
                        "overlapped": "mpi" if packed_through_mpi else "node memory"}
    assert messages["zero-copy"] == messages["plain"] == messages["in place"] == 0


def test_cross_memory_refused_on_one_rank_falls_back_with_auto_and_raises_with_true(
        comm, monkeypatch):
    import errno
    if ranks_per_node(comm) == 1:
        pytest.skip("one rank per node: no rank reads another's memory")
    if last(comm):                     # as under a restrictive ptrace policy
        def refused(*args):
            raise OSError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(mpigrad._backends.cross_memory.Mover, "read", refused)
    with Reducer(comm) as reducer:
        assert not reducer.uses_cross_memory
        check(comm, reducer.reduce(grads_of(comm, np.float32)), np.float32, True)
        assert reducer.backend in ("mpi", "node memory")
    with pytest.raises(RuntimeError, match=r"cross_memory=True cannot be had here \(rank \d: "
                                           r"process_vm_readv .* Operation not permitted"):
        Reducer(comm, cross_memory=True)


def test_a_plain_cross_memory_reduce_reads_gradients_that_fill_their_buckets_in_place(
        comm, monkeypatch):
    from mpigrad._engine.buffers import BucketBuffers
    if ranks_per_node(comm) == 1:
        pytest.skip("one rank per node: no node sums")
    copies = []
    for name in ("pack", "gather"):
        real = getattr(BucketBuffers, name)
        monkeypatch.setattr(BucketBuffers, name,
                            lambda self, *a, real=real, name=name: copies.append(name)
                            or real(self, *a))
    shapes = [(700, 3), (2000,), (5,), (6,)]     # 8400 and 8000 bytes alone; 44 packed
    grads = [pattern(s, np.float32, comm.rank, i) for i, s in enumerate(shapes)]
    with Reducer(comm, cross_memory=True, bucket_bytes=4000) as reducer:
        out = reducer.reduce(grads)
        assert reducer.backend == "cross-memory"
    assert copies == ["gather"]                  # the small gradient's bucket only
    for i, s in enumerate(shapes):
        assert_bitwise_equal(out[i], expected(s, np.float32, comm.size, i))
        assert_bitwise_equal(grads[i], pattern(s, np.float32, comm.rank, i))


@pytest.mark.parametrize("call", ["reduce", "inplace", "reduce_scatter"])
def test_cross_memory_refused_mid_run_raises_on_every_rank(comm, monkeypatch, call):
    """The kernel stops letting the last rank read and write its peers'
    memory after the Reducer was made (a ptrace policy applied mid-run):
    every rank raises PeerError naming that rank and EPERM, none waits for the
    watchdog, and calls go on once cross-memory works again."""
    import ctypes
    import errno
    reducer = cross_memory_reducer(comm, timeout=30)
    with reducer:
        grads = grads_of(comm, np.float32)
        go = {"reduce": lambda: reducer.reduce(grads),
              "inplace": lambda: reducer.reduce([g.copy() for g in grads], inplace=True),
              "reduce_scatter": lambda: reducer.reduce_scatter(grads)}[call]
        go()
        if reducer.backend != "cross-memory":          # alike on every rank
            pytest.skip(f"{call} is not summed through cross-memory here "
                        f"({reducer.backend}: the shards of more than one node move by MPI)")
        if last(comm):
            def refused(*args):
                ctypes.set_errno(errno.EPERM)
                return -1
            monkeypatch.setitem(mpigrad._backends.cross_memory._CALLS, "process_vm_readv",
                                refused)
            monkeypatch.setitem(mpigrad._backends.cross_memory._CALLS, "process_vm_writev",
                                refused)
        with pytest.raises(PeerError, match=rf"rank {comm.size - 1}: moving rank \d+'s memory "
                                            r"failed with EPERM .*run with cross_memory=False"):
            go()
        monkeypatch.undo()
        if call != "reduce_scatter":
            check(comm, reducer.reduce(grads), np.float32, True)


def stale(table):
    """Local rank 0's row of the exchange before (a message the MPI library misdelivered:
    Open MPI 5.0.x's shared-memory transport under load)."""
    table[0, 1] -= 1


def resized(table):
    """Local rank 0's first region 8 bytes larger than the plan's."""
    table[0, 4] += 8


#: a row of the exchange of addresses spoiled on one rank: (how, what that rank raises)
SPOILED_ROWS = {
    "stale": (stale, r"exchange 1, got rows of exchanges \[0, 1.*stale or misrouted.*btl "
                     r"self,tcp"),
    "resized": (resized, r"region 0: expecting \[\d+, .*bytes on the local ranks, got \["),
}


@pytest.mark.parametrize("spoiled", list(SPOILED_ROWS))
def test_an_exchange_of_addresses_spoiled_on_one_rank_raises_everywhere_and_moves_nothing(
        comm, monkeypatch, spoiled):
    """A row of the exchange of addresses that is not what its rank sent, on one rank's
    table alone (a row of another exchange, or with region sizes that are not the
    plan's), is caught before that rank moves any memory: it moves nothing, but stays in
    the call to its end (its peers, whose tables are right, move its memory meanwhile:
    were it to leave and free that memory, their writes would land in freed memory),
    where every rank, on its node and on every other node, raises PeerError naming it
    and why; none waits for the watchdog, and the Reducer goes on."""
    from mpigrad._backends.node_groups import NodeGroups
    if ranks_per_node(comm) == 1:
        pytest.skip("one rank per node: no rank reads another's memory")
    spoil, said = SPOILED_ROWS[spoiled]
    reducer = cross_memory_reducer(comm, timeout=120)
    with reducer:
        grads = grads_of(comm, np.float32)
        check(comm, reducer.reduce(grads), np.float32, True)
        if reducer.backend != "cross-memory":          # alike on every rank
            pytest.skip(f"not summed through cross-memory here ({reducer.backend})")
        moved = []
        if last(comm):
            exchange = NodeGroups.allgather_node

            def spoiling(self, values, what):
                table = exchange(self, values, what)
                if "bucket addresses" in what:
                    spoil(table)
                return table
            monkeypatch.setattr(NodeGroups, "allgather_node", spoiling)
            for call in ("process_vm_readv", "process_vm_writev"):
                move = mpigrad._backends.cross_memory._CALLS[call]
                monkeypatch.setitem(mpigrad._backends.cross_memory._CALLS, call,
                                    lambda *a, move=move: moved.append(a) or move(*a))
        began = time.monotonic()
        with pytest.raises(PeerError, match=rf"failed on rank\(s\) \[{comm.size - 1}\]: "
                                            rf"rank {comm.size - 1}: .*{said}"):
            reducer.reduce(grads)
        assert time.monotonic() - began < 60          # not the watchdog's 120 s
        assert moved == []
        monkeypatch.undo()
        check(comm, reducer.reduce(grads), np.float32, True)


@pytest.mark.parametrize("slow", ["cross-memory", "mpi"])
@pytest.mark.parametrize("inplace", [False, True])
def test_auto_measures_cross_memory_against_mpi_and_every_rank_keeps_the_faster(
        comm, monkeypatch, slow, inplace):
    # a plan's first blocking calls take cross-memory and MPI in turn (in place,
    # where every bucket is packed, node memory too; the first of each a warm-up),
    # then every rank keeps the one whose slowest rank was fastest; ``slow`` is
    # made 50 ms slower on the last rank only
    skip_unless_one_host(comm)
    monkeypatch.setenv("MPIGRAD_NODE_SIZE", str(comm.size))
    delay = 0.05 if last(comm) else 0.0
    if slow == "cross-memory":
        read = mpigrad._backends.cross_memory.Mover.read

        def slow_read(self, *args):
            time.sleep(delay)
            return read(self, *args)
        monkeypatch.setattr(mpigrad._backends.cross_memory.Mover, "read", slow_read)
        wrapped = comm
    else:
        def slow_sums(name, array):
            if np.asarray(array).dtype == np.float32:
                time.sleep(delay)
        wrapped = watching(comm, ("Allreduce", "Iallreduce"), slow_sums)
    with Reducer(wrapped) as reducer:
        if not reducer.uses_cross_memory:
            pytest.skip("cross-memory attach is refused here")
        # in place, every bucket packed: node memory is a candidate too
        candidates = ["cross-memory", "mpi"] + ["node memory"] * (
            inplace and reducer.uses_shared_memory)
        trials = len(candidates) * mpigrad._engine.choice.TRIALS
        taken, measured = [], []
        for call in range(trials + 3):
            grads = grads_of_300(comm)
            out = reducer.reduce(grads, inplace=inplace)
            for i, o in enumerate(out):
                assert_bitwise_equal(o, expected((300,), np.float32, comm.size, i))
            taken.append(reducer.backend)
            measured.append(reducer.measured)
    assert taken[:trials] == candidates * mpigrad._engine.choice.TRIALS
    assert measured[:trials] == [{}] * trials
    fastest = min(measured[trials], key=measured[trials].get)
    assert fastest != slow and taken[trials:] == [fastest] * 3
    assert set(measured[trials]) == set(candidates)
    assert measured[trials][slow] >= 50
    assert measured[trials] == measured[-1]
    assert comm.allgather((taken, measured[-1])) == [(taken, measured[-1])] * comm.size


def test_memory_on_small_pages_is_moved_onto_huge_pages_and_sums_the_same(comm, monkeypatch):
    # a gradient on 4 KiB pages (an anonymous mapping, as torch's tensors are), met in
    # every call: collapsed at its third (huge_pages), every sum before and after exact
    import mmap
    import mpigrad._base.huge_pages as huge_pages
    if ranks_per_node(comm) == 1:
        pytest.skip("one rank per node: no node sums")
    collapsed = []
    collapser = huge_pages.Collapser(huge_pages._libc_madvise())
    real = collapser.madvise
    collapser.madvise = lambda start, length: collapsed.append(length) or (
        real(start, length) if real is not None else 0)
    monkeypatch.setattr(huge_pages, "_COLLAPSER", collapser)
    shape = (huge_pages.MIN_BYTES // 4 + 1000,)
    memory = mmap.mmap(-1, shape[0] * 4)
    grad = np.frombuffer(memory, np.float32)
    with Reducer(comm, cross_memory=True) as reducer:
        for call in range(huge_pages.SEEN_CALLS + 1):
            grad[...] = pattern(shape, np.float32, comm.rank, call)
            reducer.reduce([grad], inplace=True)
            assert reducer.backend == "cross-memory"
            assert_bitwise_equal(grad, expected(shape, np.float32, comm.size, call), f"call {call}")
    assert len(collapsed) == 1 and collapsed[0] % huge_pages.HUGE_PAGE == 0 \
        and collapsed[0] >= huge_pages.MIN_BYTES - huge_pages.HUGE_PAGE
    del grad
    memory.close()


def test_a_reduce_scatters_and_an_allgathers_memory_is_never_collapsed(comm, monkeypatch):
    # FSDP2 and torch's gradients allocate these buffers anew each step, often at the
    # address the last one freed: counted, they would be collapsed again and again
    import mmap
    import mpigrad._base.huge_pages as huge_pages
    if ranks_per_node(comm) == 1:
        pytest.skip("one rank per node: no node sums")
    collapsed = []
    collapser = huge_pages.Collapser(lambda start, length: collapsed.append(length) or 0)
    monkeypatch.setattr(huge_pages, "_COLLAPSER", collapser)
    shape = (huge_pages.MIN_BYTES // 4 * comm.size + 1000 * comm.size,)
    memory = mmap.mmap(-1, shape[0] * 4)
    grad = np.frombuffer(memory, np.float32)
    with Reducer(comm, cross_memory=True, mean=False) as reducer:
        for call in range(huge_pages.SEEN_CALLS + 1):
            grad[...] = pattern(shape, np.float32, comm.rank, call)
            (shard,) = reducer.reduce_scatter([grad]).values()
            if reducer.backend != "cross-memory":          # alike on every rank
                pytest.skip(f"the reduce-scatter is not summed through cross-memory here "
                            f"({reducer.backend}: the shards of more than one node move by MPI)")
            (_, first, stop), = reducer.shards([grad])[np.dtype(np.float32)]
            whole = expected(shape, np.float32, comm.size, call, mean=False)
            assert_bitwise_equal(shard, whole[first:stop], f"call {call}")
            reducer.allgather_shards(None, [grad])
    assert collapsed == []
    del grad
    memory.close()

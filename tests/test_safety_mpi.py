"""Bad input on one rank or disagreeing ranks: an exception on every rank, never a
hang, nothing written. Run under mpiexec -n 2 and -n 3."""

import re
import time
import warnings

import numpy as np
import pytest

from helpers import assert_bitwise_equal, expected, pattern
from mpigrad import (DivergenceError, PeerError, Reducer, RowSparse, StructureMismatchError,
                     statistics)

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def last(comm):
    return comm.rank == comm.size - 1


def base_grads(comm):
    return [pattern((4, 3), np.float32, comm.rank, 0), pattern((5,), np.float16, comm.rank, 1),
            pattern((2, 2), np.float64, comm.rank, 2), pattern((7,), np.float32, comm.rank, 3)]


def assert_unchanged(comm, grads):
    for i, (got, g) in enumerate(zip(grads, base_grads(comm))):
        if isinstance(got, np.ndarray) and got.shape == g.shape and got.dtype == g.dtype:
            assert_bitwise_equal(got, g, f"grads[{i}] changed")


def assert_usable(comm, reducer):
    out = reducer.reduce(base_grads(comm))
    assert_bitwise_equal(out[0], expected((4, 3), np.float32, comm.size, 0))


def sparse(comm):
    return RowSparse(np.array([comm.rank]), np.ones((1, 5), np.float16), (3, 5))


MISMATCHES = {
    "count": (lambda c, g: g[:3], "number of gradients differs.*rank 0 has 4, rank \\d has 3"),
    "shape": (lambda c, g: g[:2] + [np.zeros((2, 3), np.float64)] + g[3:],
              r"gradient 2 differs.*dense float64\[2, 2\].*dense float64\[2, 3\]"),
    "dtype": (lambda c, g: g[:1] + [g[1].astype(np.float32)] + g[2:],
              r"gradient 1 differs.*dense float16\[5\].*dense float32\[5\]"),
    "dense vs sparse": (lambda c, g: g[:1] + [RowSparse(np.array([0]), np.ones(1, np.float16),
                                                        (5,))] + g[2:],
                        r"gradient 1 differs.*dense float16\[5\].*sparse float16\[5\]"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_gradient_mismatch_raises_everywhere(comm, case, inplace):
    change, match = MISMATCHES[case]
    grads = base_grads(comm)
    if last(comm):
        grads = change(comm, grads)
    with Reducer() as reducer:
        with pytest.raises(StructureMismatchError, match=match):
            reducer.reduce(grads, inplace=inplace)
        assert_unchanged(comm, grads)
        assert_usable(comm, reducer)


@pytest.mark.parametrize("setting, mine, theirs", [
    ("split_indices", [2], [1]), ("mean", True, False), ("degree", None, 7),
    ("bucket_bytes", None, 64), ("sparse", "auto", "gather"), ("check", True, False),
    ("timeout", 60, 30), ("verify", False, True), ("chunk_bytes", 1 << 20, 1 << 22)])
def test_setting_mismatch_raises_everywhere_at_construction(comm, setting, mine, theirs):
    with pytest.raises(StructureMismatchError, match=f"setting '{setting}' differs.*"
                                                     f"{mine!r}.*{theirs!r}"):
        Reducer(**{setting: theirs if last(comm) else mine})


def test_skip_mask_mismatch(comm):
    skip = [False, True, False, False] if last(comm) else [False] * 4
    with Reducer(skip=skip) as reducer:
        with pytest.raises(StructureMismatchError,
                           match=r"gradient 1 differs.*dense float16\[5\].*skipped"):
            reducer.reduce(base_grads(comm))


def expect_local_or_peer(comm, exc_type, match, fn):
    """The bad (last) rank raises its own error, the others PeerError naming it."""
    if last(comm):
        with pytest.raises(exc_type, match=match):
            fn()
    else:
        with pytest.raises(PeerError, match=f"rank\\(s\\) \\[{comm.size - 1}\\].*"
                                            f"{exc_type.__name__}") as info:
            fn()
        assert info.value.ranks == (comm.size - 1,)


LOCAL_ERRORS = {
    "non-array": (lambda g: g[:2] + [[1.0, 2.0]] + g[3:], TypeError,
                  r"grads\[2\]: expecting an array, got list"),
    "int dtype": (lambda g: g[:3] + [np.zeros(7, np.int32)], TypeError, r"grads\[3\].*int32"),
    "bool dtype": (lambda g: [np.zeros((4, 3), bool)] + g[1:], TypeError, r"grads\[0\].*bool"),
    "object dtype": (lambda g: g[:1] + [np.zeros(5, object)] + g[2:], TypeError,
                     r"grads\[1\].*object"),
    "not a list": (lambda g: g[0], TypeError, "list or tuple"),
}


@pytest.mark.parametrize("case", list(LOCAL_ERRORS))
def test_local_error_on_one_rank(comm, case):
    change, exc_type, match = LOCAL_ERRORS[case]
    grads = base_grads(comm)
    bad = change(grads) if last(comm) else grads
    with Reducer() as reducer:
        expect_local_or_peer(comm, exc_type, match, lambda: reducer.reduce(bad, inplace=True))
        assert_unchanged(comm, grads)
        assert_usable(comm, reducer)


def test_read_only_target_on_one_rank(comm):
    grads = base_grads(comm)
    if last(comm):
        grads[2].flags.writeable = False
    with Reducer() as reducer:
        expect_local_or_peer(comm, ValueError, r"grads\[2\].*read-only",
                             lambda: reducer.reduce(grads, inplace=True))
        assert_unchanged(comm, grads)


def test_skip_of_wrong_length_on_one_rank(comm):
    skip = [False] * (3 if last(comm) else 4)
    with Reducer(skip=skip) as reducer:
        expect_local_or_peer(comm, ValueError, "skip: expecting 4 flags.*got 3",
                             lambda: reducer.reduce(base_grads(comm)))


def test_split_index_out_of_range_on_one_rank(comm):
    grads = base_grads(comm)[:3] if last(comm) else base_grads(comm)
    with Reducer(split_indices=[3]) as reducer:
        expect_local_or_peer(comm, ValueError, "split_indices: expecting boundaries < 3",
                             lambda: reducer.reduce(grads))


@pytest.mark.parametrize("kwargs, match", [
    ({"degree": 0}, "degree.*got 0"), ({"degree": -1}, "degree.*got -1"),
    ({"degree": 2.5}, r"degree.*got 2\.5"), ({"degree": True}, "degree.*got True"),
    ({"split_indices": [3, 1]}, "strictly increasing"), ({"split_indices": [2, 2]},
                                                         "strictly increasing"),
    ({"split_indices": [0]}, "> 0"), ({"split_indices": [1.5]}, "expecting ints"),
    ({"sparse": "maybe"}, "sparse: expecting one of"), ({"bucket_bytes": 0}, "bucket_bytes"),
])
def test_bad_construction_on_one_rank(comm, kwargs, match):
    expect_local_or_peer(comm, ValueError, match,
                         lambda: Reducer(**(kwargs if last(comm) else {})))


@pytest.mark.parametrize("variable, value", [
    ("MPIGRAD_NODE_SIZE", "abc"), ("MPIGRAD_NODE_SIZE", "0"), ("MPIGRAD_TIMEOUT", "soon"),
    ("MPIGRAD_BUCKET_BYTES", "-1"), ("MPIGRAD_CHUNK_BYTES", "lots")])
def test_bad_environment_variable_on_one_rank(comm, monkeypatch, variable, value):
    if last(comm):
        monkeypatch.setenv(variable, value)
    expect_local_or_peer(comm, ValueError, f"{variable}: expecting",
                         lambda: Reducer(comm))


def test_empty_list(comm):
    with Reducer() as reducer:
        assert reducer.reduce([]) == []
        assert reducer.reduce([], inplace=True) == []


def test_nan_and_inf_propagate_without_error_or_warning(comm):
    a = np.arange(4, dtype=np.float16)
    b = np.arange(4, dtype=np.float32)
    if comm.rank == 0:
        a[1], b[2], b[3] = np.nan, np.inf, np.inf
    if last(comm):
        a[2], b[3] = np.inf, -np.inf
    big = np.full(3, 60000, np.float16)            # the sum overflows float16 on the way back
    with Reducer(mean=False) as reducer, warnings.catch_warnings():
        warnings.simplefilter("error")
        out = reducer.reduce([a, b, big])
    assert np.isnan(out[0][1]) and np.isinf(out[0][2]) and np.isinf(out[1][2])
    assert np.isnan(out[1][3])                     # inf + -inf
    assert np.isinf(out[2]).all()


def test_check_off_still_reduces(comm):
    with Reducer(check=False) as reducer:
        assert_usable(comm, reducer)
        with pytest.raises(TypeError, match=r"grads\[0\]"):       # same error on every rank
            reducer.reduce([np.zeros(2, np.int8)])


def test_timeout_path_reduces_dense_and_sparse(comm, monkeypatch):
    monkeypatch.delenv("MPIGRAD_TIMEOUT", raising=False)
    grads = base_grads(comm) + [sparse(comm)]
    with Reducer(timeout=60, sparse="gather", chunk_bytes=16) as reducer:
        assert reducer.timeout == 60.0
        out = reducer.reduce(grads)
    for i, (s, d) in enumerate([((4, 3), np.float32), ((5,), np.float16),
                                ((2, 2), np.float64), ((7,), np.float32)]):
        assert_bitwise_equal(out[i], expected(s, d, comm.size, i))
    assert out[4].indices.tolist() == list(range(comm.size))


def test_timeout_default_environment_and_explicit(comm, monkeypatch):
    monkeypatch.delenv("MPIGRAD_TIMEOUT", raising=False)
    with Reducer() as reducer:
        assert reducer.timeout == 600.0              # on by default
    monkeypatch.setenv("MPIGRAD_TIMEOUT", "12.5")
    with Reducer() as reducer, Reducer(timeout=3) as explicit, Reducer(timeout=None) as off:
        assert (reducer.timeout, explicit.timeout, off.timeout) == (12.5, 3.0, None)
    monkeypatch.setenv("MPIGRAD_TIMEOUT", "0")
    with Reducer() as reducer:
        assert reducer.timeout is None
    monkeypatch.setenv("MPIGRAD_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MPIGRAD_TIMEOUT.*'soon'"):
        Reducer()


def test_verify_passes_on_agreeing_ranks(comm):
    with Reducer(verify=True, sparse="gather") as reducer:
        out = reducer.reduce(base_grads(comm) + [sparse(comm)])
    assert_bitwise_equal(out[3], expected((7,), np.float32, comm.size, 3))


def skewing(comm, skewed):
    """A communicator like ``comm`` on which, where ``skewed``, this rank's
    float sums come out 1 too high in their first element: an MPI library
    that diverges. Every rank wraps alike (Reducers share the duplicate of
    each kind of parent communicator)."""
    from mpi4py import MPI

    def skew(recv):
        if not skewed:
            return
        array = recv[0] if isinstance(recv, (list, tuple)) else recv
        if array.dtype.kind == "f" and array.size:
            array[:1] += 1

    def allreduce(self, send, recv, op=MPI.SUM):
        MPI.Intracomm.Allreduce(self, send, recv, op)
        skew(recv)

    def iallreduce(self, send, recv, op=MPI.SUM):
        MPI.Intracomm.Iallreduce(self, send, recv, op).Wait()
        skew(recv)
        return MPI.Request()              # already complete

    kind = type("Skewing", (MPI.Intracomm,), {"Allreduce": allreduce,
                                               "Iallreduce": iallreduce})
    return kind(comm)


def test_verify_catches_divergence_and_writes_nothing(comm):
    with Reducer(skewing(comm, last(comm)), verify=True) as reducer:
        grads = base_grads(comm)
        with pytest.raises(DivergenceError, match="differ across ranks"):
            reducer.reduce(grads, inplace=True)
        assert_unchanged(comm, grads)


# -- issue: every probe's case an error on every rank --------------------------

class Blocking:
    """A DLPack array whose conversion waits for ``release``: a call that
    reads it stays inside the Reducer until then."""

    def __init__(self, array, entered, release):
        self.array, self.entered, self.release = array, entered, release

    def __dlpack__(self, **kwargs):
        self.entered.set()
        assert self.release.wait(30)
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_a_second_thread_is_refused_and_nothing_is_corrupted(comm):
    import threading
    entered, release = threading.Event(), threading.Event()
    grads = [Blocking(pattern((6,), np.float32, comm.rank, 0), entered, release)]
    results = []
    with Reducer(comm) as reducer:
        worker = threading.Thread(target=lambda: results.append(reducer.reduce(grads)))
        worker.start()
        assert entered.wait(30)
        with pytest.raises(RuntimeError, match="one thread at a time"):
            reducer.reduce(base_grads(comm))            # refused: issues nothing
        release.set()
        worker.join(30)
        assert_bitwise_equal(results[0][0], expected((6,), np.float32, comm.size, 0))
        assert_usable(comm, reducer)


def test_reducers_on_their_own_communicators_work_in_two_threads(comm):
    import threading
    comms = [comm.Dup(), comm.Dup()]
    reducers = [Reducer(c) for c in comms]
    outs = [None, None]

    def work(k):
        for _ in range(20):
            outs[k] = reducers[k].reduce(base_grads(comm))
    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r, c in zip(reducers, comms):
        r.free()
        c.Free()
    for out in outs:
        assert_bitwise_equal(out[0], expected((4, 3), np.float32, comm.size, 0))


ALIASES = {
    "same array": lambda big: [big, big],
    "overlapping views": lambda big: [big[:1 << 17], big[1000:]],
    "through a memoryview": lambda big: [big, np.frombuffer(memoryview(big), np.float32)],
    "reversed": lambda big: [big[::-1], big[5:]],
    "torch tensors of it": lambda big: [torch_of(big), torch_of(big)],
    "numpy and torch": lambda big: [big, torch_of(big)],
    "small, packed together": lambda big: [big[:64], big[:4]],
}


def torch_of(array):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(array)


def test_interleaved_views_of_one_array_are_not_aliases(comm):
    big = pattern((1 << 19,), np.float32, comm.rank, 0)             # spans overlap, memory not
    with Reducer(comm, mean=False) as reducer:
        out = reducer.reduce([big[::2], big[1::2]], inplace=True)
    want = expected((1 << 19,), np.float32, comm.size, 0, mean=False)
    assert_bitwise_equal(out[0], want[::2])
    assert_bitwise_equal(out[1], want[1::2])


@pytest.mark.parametrize("views", list(ALIASES))
def test_aliased_inplace_gradients_raise_before_writing(comm, views):
    big = pattern((1 << 18,), np.float32, comm.rank, 0)             # 1 MiB
    aliased = ALIASES[views](big)
    # the same structure everywhere; only the last rank's gradients alias
    grads = aliased if last(comm) else [pattern(tuple(a.shape), np.float32, comm.rank, i)
                                        for i, a in enumerate(aliased)]
    before = big.copy()
    with Reducer(comm) as reducer:
        expect_local_or_peer(comm, ValueError, r"grads\[0\] and grads\[1\] share memory",
                             lambda: reducer.reduce(grads, inplace=True))
        assert_usable(comm, reducer)
    assert_bitwise_equal(big, before)


def test_a_reduction_started_before_free_raises_at_wait(comm):
    reducer = Reducer(comm)
    pending = reducer.start(base_grads(comm))
    # every rank out of start() first: a peer still inside its check would
    # rightly raise PeerError on a goodbye from a rank that freed
    comm.Barrier()
    reducer.free()
    with pytest.raises(RuntimeError, match="this Reducer was freed"):
        pending.wait()


def test_freed_reducer_raises_and_its_peers_get_peer_error(comm):
    reducer = Reducer(comm)
    reducer.free()
    for call in (lambda: reducer.reduce(base_grads(comm)), lambda: reducer.start([])):
        with pytest.raises(RuntimeError, match="this Reducer was freed"):
            call()
    twin = Reducer(comm)
    if last(comm):
        twin.free()
    else:
        with pytest.raises(PeerError, match=f"rank\\(s\\) \\[.*{comm.size - 1}\\].*freed the group"):
            twin.reduce(base_grads(comm))
        twin.free()


def test_a_collective_left_incomplete_keeps_its_communicator_from_reuse(comm):
    """The peers of a rank that freed its Reducer raise PeerError inside the
    agreement it never joins, leaving that Allgather incomplete: its messages
    may wait in some rank's queue. Were the duplicate freed, MPI would give its
    context to a later communicator, whose first Allgather at the same place
    of its sequence matches them (a stale slot taken for a peer's: the ranks
    disagreed, then stalled; seen 1 run in 2-5 of the safety-to-sparse files at
    3 ranks). So it is kept on every rank, while a cleanly freed one is freed."""
    from mpi4py import MPI
    clean, twin = Reducer(comm), Reducer(comm)
    clean_dup, twin_dup = clean.comm, twin.comm
    clean.free()
    comm.Barrier()
    before = statistics().operations
    if last(comm):
        time.sleep(1.0)                     # the others are inside the agreement by now
        twin.free()
    else:
        with pytest.raises(PeerError, match="freed the group"):
            twin.reduce(base_grads(comm))
        twin.free()
    # a rank whose goodbye came first raises before starting anything: nothing is left
    started = any(comm.allgather(statistics().operations > before))
    for _ in range(50):                     # every goodbye arrives; new Reducers free the old
        comm.Barrier()
        time.sleep(0.02)
        with Reducer(comm) as reducer:
            assert_usable(comm, reducer)
        if clean_dup == MPI.COMM_NULL:
            break
    assert clean_dup == MPI.COMM_NULL                  # freed once every goodbye came
    assert started                                     # (else this tested nothing)
    assert twin_dup != MPI.COMM_NULL and twin_dup.Get_size() == comm.size    # kept


def test_an_mpi_error_on_one_rank_mid_call_raises_peer_error_on_the_others(comm, monkeypatch):
    """An error the MPI library reports on one rank in the middle of a call (a message
    truncated or misdelivered: Open MPI's, under load), not a lost rank, is that rank's
    alone: it raises there and leaves the call, and its peers, waiting on it in the
    data's collectives, raise PeerError naming it at once (not the watchdog's abort a
    timeout later, nor a stall where the caller goes on to other collectives: a rank
    that ended the call by it told its peers it had done its part)."""
    from mpi4py import MPI
    from mpigrad._backends import flight

    def truncated(*args, **kwargs):
        raise MPI.Exception(MPI.ERR_TRUNCATE)

    with Reducer(comm, shared_memory=False, timeout=60) as reducer:
        reducer.reduce(base_grads(comm), inplace=True)            # planned, through MPI
        if last(comm):
            monkeypatch.setattr(flight.Sums, "add", truncated)
            with pytest.raises(MPI.Exception):
                reducer.reduce(base_grads(comm), inplace=True)
        else:
            began = time.monotonic()
            with pytest.raises(PeerError, match=f"rank\\(s\\) \\[{comm.size - 1}\\].*"
                                                "abandoned call 2"):
                reducer.reduce(base_grads(comm), inplace=True)
            assert time.monotonic() - began < 30


def test_inputs_byte_order_masked_and_complex_mean(comm):
    with Reducer(comm) as reducer:
        expect_local_or_peer(comm, TypeError, r"grads\[1\].*big-endian float32 \('>f4'\)",
                             lambda: reducer.reduce(base_grads(comm)[:1] + [
                                 np.ones(5, ">f4" if last(comm) else "<f2")]))
        masked = np.ma.masked_array(np.ones(5, np.float16), mask=[0, 1, 0, 0, 0])
        expect_local_or_peer(comm, TypeError, r"grads\[1\].*mask",
                             lambda: reducer.reduce(base_grads(comm)[:1] + [
                                 masked if last(comm) else np.ones(5, np.float16)]))
        z = np.array([np.inf + 1j, 3 + 3j], np.complex64)
        out = reducer.reduce([z])[0]
    assert np.isinf(out[0].real) and out[0].imag == np.float32(1.0)
    assert out[1] == np.complex64(3 + 3j)


@pytest.mark.parametrize("call", ["reduce", "start", "wait"])
def test_agreed_values_that_differ_raise_everywhere_and_write_nothing(comm, call):
    grads = base_grads(comm)
    step = {"step": 7 if last(comm) else 6}
    with Reducer() as reducer:
        with pytest.raises(StructureMismatchError,
                           match=r"'step' differs across ranks: rank 0 has 6, rank \d has 7"):
            if call == "reduce":
                reducer.reduce(grads, inplace=True, agree=step)
            elif call == "start":
                reducer.start(grads, agree=step)
            else:
                reducer.start(grads, agree={"step": 6}).wait(agree=step)
        if call != "wait":            # a finished overlapped call has summed in place
            assert_unchanged(comm, grads)
        out = reducer.reduce(base_grads(comm), agree={"step": 6, "phase": "warm-up"})
        assert_bitwise_equal(out[0], expected((4, 3), np.float32, comm.size, 0))
        missing = None if last(comm) else {"phase": "warm-up"}
        with pytest.raises(StructureMismatchError,
                           match=r"'phase' differs across ranks: rank 0 has 'warm-up', "
                                 r"rank \d has None"):
            reducer.reduce(base_grads(comm), agree=missing)
        assert_usable(comm, reducer)


def test_agreed_values_of_a_bad_kind_on_one_rank(comm):
    with Reducer() as reducer:
        agree = {"step": object()} if last(comm) else {"step": 1}
        error = TypeError if last(comm) else PeerError
        with pytest.raises(error, match="agree: expecting str names and values"):
            reducer.reduce(base_grads(comm), agree=agree)
        pending = reducer.start(base_grads(comm))
        with pytest.raises(error, match="agree: expecting a dict"):
            pending.wait(agree=[1] if last(comm) else None)
        assert_usable(comm, reducer)


# check=False: messages of the same sizes that mean different things
UNCHECKED_MISMATCHES = {
    "float64[2] against float32[4]": lambda mine: [np.ones(2, np.float64)] if mine else
    [np.ones(4, np.float32)],
    "two gradients against one": lambda mine: [np.ones(2, np.float32)] * 2 if mine else
    [np.ones(4, np.float32)],
}


@pytest.mark.parametrize("case", list(UNCHECKED_MISMATCHES))
def test_check_off_finds_different_calls_beside_the_data(comm, case):
    grads = UNCHECKED_MISMATCHES[case](last(comm))
    with Reducer(check=False) as reducer:
        with pytest.raises(StructureMismatchError, match="check=False: the ranks made different"):
            reducer.reduce(grads)
        with pytest.raises(StructureMismatchError, match="check=False: the ranks made different"):
            reducer.start([np.ones(4, np.float32)], agree={"step": int(last(comm))}).wait()
        assert_usable(comm, reducer)


@pytest.mark.parametrize("face", ["reducer", "functions"])
def test_different_calls_across_faces_are_named_on_every_rank(comm, face):
    """One rank reduces (or broadcasts) where another gathers objects over the
    same communicator: the report names both calls, and the next call works."""
    import mpigrad
    if comm.size == 1:
        pytest.skip("a communicator of size 1 has no other rank")
    last = comm.rank == comm.size - 1
    grads = [np.full(4, comm.rank + 1.0, np.float32)]
    with Reducer(comm, timeout=30) as reducer:
        first = "reduce(inplace=False)" if face == "reducer" else "broadcast"
        with pytest.raises(StructureMismatchError,
                           match=re.escape(f"expecting the same call on every rank, got {first} "
                                           f"on rank 0 and allgather_object on rank "
                                           f"{comm.size - 1}")):
            if face == "reducer":
                reducer.allgather_object(comm.rank) if last else reducer.reduce(grads)
            else:
                (mpigrad.allgather_object(comm.rank, comm=comm) if last
                 else mpigrad.broadcast(grads, root=0, comm=comm))
        assert reducer.allgather_object(comm.rank) == list(range(comm.size))
        assert mpigrad.allgather_object(comm.rank, comm=comm) == list(range(comm.size))

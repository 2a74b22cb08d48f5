"""mpigrad.broadcast: any pytree of arrays (numpy, torch, jax; numeric and bool
dtypes) and python values equals root's on every rank, in place where
writeable; structure differences raise on every rank and write nothing. Run
under mpiexec -n 2 and -n 3."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_bitwise_equal
import mpigrad
from mpigrad import StructureMismatchError
from mpigrad._base.dtypes import bfloat16

pytestmark = pytest.mark.mpi(min_size=2)

DTYPES = [np.float32, np.float64, np.float16, bfloat16, np.int64, np.int32, np.uint8,
          np.bool_, np.complex64]


def leaf(shape, dtype, rank, seed):
    values = (np.arange(int(np.prod(shape))) * (seed + 3) + 7 * rank + seed) % 9
    return values.reshape(shape).astype(dtype)


def test_numpy_tree_in_place_and_values_by_value(comm):
    root = comm.size - 1
    tree = {"w": leaf((3, 2), np.float32, comm.rank, 0),
            "int": [leaf((4,), np.int64, comm.rank, 1), leaf((), np.bool_, comm.rank, 2)],
            "bf16": leaf((5,), bfloat16, comm.rank, 3), "step": comm.rank * 10,
            "name": f"rank {comm.rank}", "none": None}
    before = tree["w"]
    out = mpigrad.broadcast(tree, root=root, comm=comm)
    assert out["w"] is before                                  # in place
    assert_bitwise_equal(out["w"], leaf((3, 2), np.float32, root, 0))
    assert_bitwise_equal(out["int"][0], leaf((4,), np.int64, root, 1))
    assert_bitwise_equal(out["int"][1], leaf((), np.bool_, root, 2))
    assert_bitwise_equal(out["bf16"], leaf((5,), bfloat16, root, 3))
    assert (out["step"], out["name"], out["none"]) == (root * 10, f"rank {root}", None)


def test_read_only_arrays(comm):
    a = leaf((4,), np.float32, comm.rank, 0)
    a.flags.writeable = False
    out = mpigrad.broadcast([a], root=0, comm=comm)
    assert_bitwise_equal(out[0], leaf((4,), np.float32, 0, 0))
    if comm.rank != 0:
        assert out[0] is not a and a.tolist() == leaf((4,), np.float32, comm.rank, 0).tolist()


def test_torch_state_dict_parameters_and_bf16(comm):
    torch = pytest.importorskip("torch")
    torch.manual_seed(comm.rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    model[1].num_batches_tracked += comm.rank
    half = torch.full((3,), comm.rank + 0.5, dtype=torch.bfloat16)
    state = model.state_dict()
    mpigrad.broadcast({"model": state, "half": half}, root=0, comm=comm)
    for p in model.parameters():                   # parameters that require grad: in place
        assert p.requires_grad
    want = [t.clone() for t in state.values()]
    got = comm.bcast(want, root=0)
    for mine, root in zip(state.values(), got):
        assert torch.equal(mine, root)
    assert torch.equal(half, torch.full((3,), 0.5, dtype=torch.bfloat16))
    assert int(model[1].num_batches_tracked) == 0


def test_jax_arrays_come_back_new(comm):
    jax = pytest.importorskip("jax")
    params = {"w": jax.numpy.full((2,), float(comm.rank))}
    out = mpigrad.broadcast(params, root=0, comm=comm)
    assert isinstance(out["w"], jax.Array) and np.asarray(out["w"]).tolist() == [0.0, 0.0]


def test_a_second_array_on_one_rank_raises_everywhere_and_the_next_bcast_is_clean(comm):
    from mpi4py import MPI
    if comm.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    arrays = [np.full(2, 7.0)] + ([np.full(2, 7.0)] if comm.rank == 1 else [])
    with pytest.raises(StructureMismatchError, match="differs"):
        mpigrad.broadcast(arrays, root=0, comm=comm)
    assert arrays[0].tolist() == [7.0, 7.0]                # nothing written
    value = np.array([42.0 if comm.rank == 0 else 0.0])
    comm.Bcast([value, MPI.DOUBLE], root=0)                # the caller's own next message
    assert value[0] == 42.0


@pytest.mark.parametrize("change", ["shape", "dtype", "key", "value vs array"])
def test_structure_differences_raise_everywhere(comm, change):
    if comm.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    tree = {"a": np.zeros(3, np.float32), "b": 1}
    if comm.rank == comm.size - 1:
        tree = {"shape": {"a": np.zeros(4, np.float32), "b": 1},
                "dtype": {"a": np.zeros(3, np.float64), "b": 1},
                "key": {"c": np.zeros(3, np.float32), "b": 1},
                "value vs array": {"a": np.zeros(3, np.float32), "b": np.zeros(1)}}[change]
    with pytest.raises(StructureMismatchError):
        mpigrad.broadcast(tree, root=0, comm=comm)


def test_bad_root_or_leaf_on_one_rank_is_an_error_everywhere(comm):
    from mpigrad import PeerError
    bad = comm.rank == comm.size - 1
    with pytest.raises(ValueError if bad else PeerError, match="root|rank"):
        mpigrad.broadcast([np.zeros(2)], root=comm.size if bad else 0, comm=comm)
    with pytest.raises(TypeError if bad else PeerError, match="leaf 0|rank"):
        mpigrad.broadcast([object() if bad else np.zeros(2)], comm=comm)


@st.composite
def trees(draw, depth=2):
    kind = draw(st.sampled_from(["array", "value"] + (["list", "dict"] if depth else [])))
    if kind == "array":
        return ("array", draw(st.lists(st.integers(0, 3), max_size=3).map(tuple)),
                draw(st.sampled_from(DTYPES)))
    if kind == "value":
        return ("value", draw(st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3))))
    children = draw(st.lists(trees(depth=depth - 1), min_size=1, max_size=3))
    if kind == "list":
        return ("list", children)
    return ("dict", {f"k{i}": c for i, c in enumerate(children)})


def build(spec, rank, seed=0):
    kind = spec[0]
    if kind == "array":
        return leaf(spec[1], spec[2], rank, seed)
    if kind == "value":
        return f"rank {rank}'s value" if rank else spec[1]     # any value: root's wins
    if kind == "list":
        return [build(c, rank, seed + i) for i, c in enumerate(spec[1])]
    return {k: build(c, rank, seed + i) for i, (k, c) in enumerate(spec[1].items())}


def same(a, b):
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=40, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(spec=trees(), root_pick=st.integers(0, 2))
def test_random_trees_equal_roots_on_every_rank(spec, root_pick):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    spec, root_pick = comm.bcast((spec, root_pick))
    root = root_pick % comm.size
    failed = None
    try:
        out = mpigrad.broadcast(build(spec, comm.rank), root=root)
        if not same(out, build(spec, root)):
            failed = "differs from root's"
    except Exception as exc:                  # noqa: BLE001  (decided on every rank)
        failed = f"raised {type(exc).__name__}: {exc}"
    verdicts = comm.allgather(failed)
    assert not any(verdicts), verdicts


def mutate(spec, how):
    """A different structure: an extra leaf, a renamed key, or the first
    array's shape or dtype changed (the tree itself when there is none)."""
    if how == "extra leaf":
        return ("list", [spec, ("value", 1)])
    kind = spec[0]
    if kind == "array":
        shape, dtype = spec[1], spec[2]
        if how == "shape":
            return ("array", shape + (2,), dtype)
        return ("array", shape, np.float64 if dtype != np.float64 else np.float32)
    if kind == "dict" and how == "key":
        return ("dict", {k + "x": c for k, c in spec[1].items()})
    if kind in ("list", "dict"):
        items = list(spec[1].items()) if kind == "dict" else list(enumerate(spec[1]))
        changed = [(k, mutate(c, how)) for k, c in items[:1]] + items[1:]
        return (kind, dict(changed) if kind == "dict" else [c for _, c in changed])
    return ("list", [spec])                      # a value: nest it


@settings(max_examples=30, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(spec=trees(), how=st.sampled_from(["extra leaf", "key", "shape", "dtype"]))
def test_random_structure_differences_raise_on_every_rank(spec, how):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    spec, how = comm.bcast((spec, how))
    mine = mutate(spec, how) if comm.rank == comm.size - 1 else spec
    outcome = "returned"
    try:
        mpigrad.broadcast(build(mine, comm.rank), root=0)
    except StructureMismatchError:
        outcome = "mismatch"
    except Exception as exc:                  # noqa: BLE001  (decided on every rank)
        outcome = f"raised {type(exc).__name__}: {exc}"
    differs = comm.allreduce(int(repr(mine) != repr(spec)), op=MPI.MAX)
    verdicts = comm.allgather(outcome)
    assert verdicts == ["mismatch" if differs else "returned"] * comm.size, (mine, verdicts)


def test_roots_that_differ_across_ranks_raise_everywhere_and_write_nothing(comm):
    if comm.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    mine = np.full(3, float(comm.rank))
    with pytest.raises(StructureMismatchError, match="setting 'root' differs across ranks"):
        mpigrad.broadcast([mine], root=comm.rank, comm=comm)
    assert (mine == comm.rank).all()


@pytest.mark.parametrize("root", [True, 1.0, -1, "0"])
def test_a_root_must_be_an_int_rank(comm, root):
    with pytest.raises(ValueError, match="root: expecting a rank"):
        mpigrad.broadcast([np.zeros(2)], root=root, comm=comm)

"""mpigrad.shard.Sharded: a sharded Adam step (numpy, and optax on jax arrays)
gives the unsharded run's parameters, the same on every rank, with 1/p of the
optimizer state per rank. Run under mpiexec -n 2 and -n 3."""

import numpy as np
import pytest

from helpers import assert_same_on_all_ranks, pattern
from mpigrad import Reducer
from mpigrad.shard import Sharded

pytestmark = pytest.mark.mpi(min_size=2)

SHAPES = [(40, 7), (5,), (1,), (333,)]
STEPS = 20


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def adam_init(params):
    return {"t": 0, "m": {d: np.zeros_like(p) for d, p in params.items()},
            "v": {d: np.zeros_like(p) for d, p in params.items()}}


def adam(params, grads, state, lr=0.01, b1=0.9, b2=0.999, eps=1e-8):
    """Elementwise Adam on numpy arrays, in place (any layout of elements)."""
    state["t"] += 1
    t = state["t"]
    for key in params:
        m, v, g = state["m"][key], state["v"][key], grads[key]
        m[...] = b1 * m + (1 - b1) * g
        v[...] = b2 * v + (1 - b2) * g * g
        params[key] -= lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return state


def gradients(comm, step, dtypes):
    return [pattern(s, d, comm.rank, step * 10 + i) for i, (s, d) in enumerate(zip(SHAPES, dtypes))]


@pytest.mark.parametrize("dtypes", [[np.float32] * 4, [np.float32, np.float64, np.float16, np.float32]],
                         ids=["float32", "mixed"])
def test_sharded_numpy_adam_equals_the_unsharded_run_bitwise(comm, dtypes):
    start = [np.linspace(-1, 1, int(np.prod(s))).reshape(s).astype(d) for s, d in zip(SHAPES, dtypes)]
    params = [p.copy() for p in start]
    with Reducer(comm) as reducer:
        step = Sharded(params, adam, init=adam_init, reducer=reducer)
        full = {i: p.astype(np.float32 if p.dtype == np.float16 else p.dtype) for i, p in enumerate(start)}
        state = adam_init(full)
        for k in range(STEPS):
            grads = gradients(comm, k, dtypes)
            out = step(grads)
            mean = reducer.reduce(grads)
            adam(full, {i: g.astype(full[i].dtype) for i, g in enumerate(mean)}, state)
        assert all(o is p for o, p in zip(out, params))          # numpy: in place
        for i, p in enumerate(params):
            np.testing.assert_array_equal(p, full[i].astype(p.dtype), err_msg=f"param {i}")
        assert_same_on_all_ranks(comm, params)
        unsharded = sum(a.nbytes for a in state["m"].values()) * 2
        sharded = sum(a.nbytes for a in step.state["m"].values()) * 2
        assert sharded <= unsharded / comm.size + 64           # 1/p, a few elements over


def test_sharded_optax_adam_on_jax_arrays_equals_the_unsharded_run(comm):
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    params = {"w": jnp.linspace(-1, 1, 280).reshape(40, 7), "b": jnp.zeros(5)}
    tx = optax.adam(0.01)
    with Reducer(comm) as reducer:
        step = Sharded(params, tx, reducer=reducer)
        full, state = params, tx.init(params)
        sharded = params
        for k in range(STEPS):
            grads = {"w": jnp.asarray(pattern((40, 7), np.float32, comm.rank, k)),
                     "b": jnp.asarray(pattern((5,), np.float32, comm.rank, k + 100))}
            sharded = step(grads)
            mean = reducer.reduce(grads)
            updates, state = tx.update(mean, state, full)
            full = optax.apply_updates(full, updates)
        for key in params:
            assert type(sharded[key]) is type(params[key])
            np.testing.assert_allclose(np.asarray(sharded[key]), np.asarray(full[key]),
                                       rtol=0, atol=1e-6)
        assert_same_on_all_ranks(comm, [np.asarray(sharded[k]) for k in sorted(sharded)])
        assert step.state_bytes() < 2 * 4 * 285 / comm.size + 64


def run_steps(step, comm, first, last, dtypes, size=None, rank=None):
    """Steps ``first``..``last - 1`` with the gradients of a world of ``size``
    ranks (default the communicator's) averaged: this rank's part of them."""
    size = comm.size if size is None else size
    rank = comm.rank if rank is None else rank
    for k in range(first, last):
        grads = [np.mean([pattern(s, np.float64, r, k * 10 + i) for r in range(comm.size)],
                         axis=0) for i, s in enumerate(SHAPES)]
        # every rank's gradient the same mean: any world size sees the same mean
        step([g.astype(d) for g, d in zip(grads, dtypes)])


@pytest.mark.parametrize("kind", ["numpy", "optax"])
def test_state_dict_reshards_at_another_world_size(comm, kind):
    """Save at N ranks, load at N - 1 (a sub-communicator), go on: the run
    that never stopped, to float32 rounding."""
    if kind == "optax":
        optax = pytest.importorskip("optax")
        import jax.numpy as jnp
        dtypes = [np.float32] * 4

        def make(params, reducer):
            return Sharded([jnp.asarray(p) for p in params], optax.adam(0.01), reducer=reducer)
    else:
        dtypes = [np.float32, np.float64, np.float16, np.float32]

        def make(params, reducer):
            return Sharded(params, adam, init=adam_init, reducer=reducer)
    start = [np.linspace(-1, 1, int(np.prod(s))).reshape(s).astype(d) for s, d in zip(SHAPES, dtypes)]
    with Reducer(comm) as reducer:
        step = make([p.copy() for p in start], reducer)
        run_steps(step, comm, 0, 3, dtypes)
        saved = step.state_dict()
        run_steps(step, comm, 3, 6, dtypes)
        never_stopped = [np.asarray(p) for p in step.params]
    sub = comm.Split(0 if comm.rank < comm.size - 1 else 1, comm.rank)
    if comm.rank < comm.size - 1:
        with Reducer(sub) as reducer:
            params = [np.asarray(p).astype(d) for p, d in zip(saved["params"], dtypes)]
            resumed = make(params, reducer)
            resumed.load_state_dict(saved)
            run_steps(resumed, comm, 3, 6, dtypes)
            for got, want in zip(resumed.params, never_stopped):
                tolerance = 1e-3 if want.dtype == np.float16 else 1e-6
                assert np.allclose(np.asarray(got), want, rtol=tolerance, atol=tolerance)
    sub.Free()

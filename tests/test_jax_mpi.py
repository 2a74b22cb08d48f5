"""mpigrad.jax inside jax.jit: a whole flax + optax step compiled, gradients
through the reductions, lax.scan, vmap, mismatches and many calls per step,
against references computed from the rank count."""

import time

import numpy as np
import pytest

from mpigrad import Reducer

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
mj = pytest.importorskip("mpigrad.jax")

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def same_on_every_rank(comm, tree):
    mine = b"".join(np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree))
    return all(other == mine for other in comm.allgather(mine))


def test_reduce_inside_jit_gives_the_bits_of_reduce_outside(comm):
    rank, size = comm.rank, comm.size
    tree = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 7 * (rank + 1),
            "b": jnp.full((5,), rank + 0.25, jnp.bfloat16),
            "h": [jnp.linspace(0, 1, 9, dtype=jnp.float16) * (rank + 1)]}
    with Reducer() as reducer:
        inside = jax.jit(lambda t: mj.reduce(t, reducer))(tree)
        outside = reducer.reduce(tree)
    for a, b in zip(jax.tree_util.tree_leaves(inside), jax.tree_util.tree_leaves(outside)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    want = np.arange(12, dtype=np.float32).reshape(3, 4) / 7 * sum(range(1, size + 1)) / size
    np.testing.assert_allclose(np.asarray(inside["w"]), want, rtol=1e-6)


def test_equal_gradients_in_one_buffer_inside_jit(comm):
    """XLA hands the host call one buffer for equal operands: unused parameters' zero
    gradients, a leaf given twice. They reduce as outside jit (they raised "share
    memory" on every rank: only the results may not share)."""
    rank = comm.rank
    params = {"w": jnp.ones(3), "unused": jnp.ones(4), "also_unused": jnp.ones(4),
              "h": jnp.ones(4, jnp.float16)}

    def loss(p, x):
        return (p["w"] * x).sum()

    x = jnp.full(3, 1.0 + rank)
    twice = jnp.arange(4.0) * (rank + 1)
    with Reducer(mean=False) as reducer:
        grads = jax.jit(lambda p: mj.reduce(jax.grad(loss)(p, x), reducer))(params)
        tree = jax.jit(lambda t: mj.reduce(t, reducer))([twice, jnp.ones(2), twice])
    size = comm.size
    np.testing.assert_array_equal(np.asarray(grads["w"]), np.full(3, size * (size + 1) / 2))
    for name in ("unused", "also_unused", "h"):
        assert grads[name].dtype == params[name].dtype
        np.testing.assert_array_equal(np.asarray(grads[name]), np.zeros(4))
    for leaf in (tree[0], tree[2]):
        np.testing.assert_array_equal(np.asarray(leaf), np.arange(4.0) * size * (size + 1) / 2)


def test_grad_through_allreduce_is_the_analytic_gradient(comm):
    """Every rank's loss is sum(s**2), s the sum over ranks of (rank+1)*x:
    the gradient of the ranks' total loss at rank r is size * 2 s (r+1)."""
    rank, size = comm.rank, comm.size
    x = jnp.arange(4, dtype=jnp.float32)

    def loss(v):
        return jnp.sum(mj.allreduce(v * (rank + 1), "sum") ** 2)
    got = jax.jit(jax.grad(loss))(x)
    s = sum(range(1, size + 1)) * np.arange(4, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(got), size * 2 * s * (rank + 1), rtol=1e-6)

    def mean_loss(v):
        return jnp.sum(mj.allreduce(v * (rank + 1), "mean"))
    got = jax.jit(jax.grad(mean_loss))(x)        # d/dx_r of sum_q mean: (r+1), every rank
    np.testing.assert_allclose(np.asarray(got), np.full(4, rank + 1.0), rtol=1e-6)


def test_metrics_inside_jit(comm):
    rank, size = comm.rank, comm.size
    step = jax.jit(lambda v: (mj.allreduce(v, "sum"), mj.allreduce(v, "mean"),
                              mj.allreduce(v, "max"), mj.allreduce(v, "min"),
                              mj.allreduce(jnp.int32(rank), "mean")))
    total, mean, high, low, int_mean = step(jnp.float32(rank + 1))
    assert float(total) == size * (size + 1) / 2 and float(mean) == (size + 1) / 2
    assert float(high) == size and float(low) == 1
    assert int_mean.dtype == jnp.float32 and float(int_mean) == (size - 1) / 2
    with pytest.raises(ValueError, match="expecting one of"):
        mj.allreduce(jnp.float32(1), "prod")


def test_a_scan_of_four_micro_batches(comm):
    rank, size = comm.rank, comm.size
    with Reducer(mean=False) as reducer:
        def body(total, batch):
            return total + mj.reduce(batch * (rank + 1), reducer), None
        batches = jnp.arange(12, dtype=jnp.float32).reshape(4, 3)
        total, _ = jax.jit(lambda b: jax.lax.scan(body, jnp.zeros(3, jnp.float32), b))(batches)
    want = np.arange(12, dtype=np.float32).reshape(4, 3).sum(0) * sum(range(1, size + 1))
    np.testing.assert_allclose(np.asarray(total), want, rtol=1e-6)


def test_a_reduction_inside_lax_cond(comm):
    rank, size = comm.rank, comm.size

    @jax.jit
    def step(flag, v):
        return jax.lax.cond(flag, lambda x: mj.allreduce(x, "sum"), lambda x: x * 0, v)
    got = step(True, jnp.full(3, rank + 1.0, jnp.float32))
    assert np.asarray(got).tolist() == [size * (size + 1) / 2] * 3
    assert np.asarray(step(False, jnp.ones(3, jnp.float32))).tolist() == [0.0] * 3


def test_without_the_ordered_primitive_io_callback_gives_the_same_bits(comm, monkeypatch):
    """jax without the internals of mpigrad's ordered primitive: the ordered
    io_callback path (copies)."""
    import mpigrad.jax.host_call as host_call
    rank = comm.rank
    tree = {"w": jnp.arange(10, dtype=jnp.float32) / 3 * (rank + 1),
            "h": jnp.linspace(0, 1, 7, dtype=jnp.float16) * (rank + 1)}
    with Reducer() as reducer:
        outside = reducer.reduce(tree)
        monkeypatch.setattr(host_call.ordered_primitive, "primitive", False)
        inside = jax.jit(lambda t: mj.reduce(t, reducer))(tree)
        grad = jax.jit(jax.grad(lambda v: jnp.sum(mj.reduce([v * (rank + 1)], reducer)[0])))(
            jnp.ones(2, jnp.float32))
    for a, b in zip(jax.tree_util.tree_leaves(inside), jax.tree_util.tree_leaves(outside)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # d/dv_r of the ranks' total of the mean: (r+1) on every rank r
    np.testing.assert_allclose(np.asarray(grad), np.full(2, rank + 1.0), rtol=1e-6)


def test_per_device_values_inside_shard_map_are_refused_naming_the_fix(comm):
    from jax.sharding import Mesh, PartitionSpec
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    body = jax.shard_map(lambda x: mj.reduce([x])[0], mesh=mesh,
                         in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d"))
    with pytest.raises(ValueError, match=r"inside shard_map .*\['d'\].*jax.lax.psum"):
        jax.jit(body)(jnp.ones(4, jnp.float32))


def test_vmap_batches_into_one_call(comm):
    rank, size = comm.rank, comm.size
    batched = jax.jit(jax.vmap(lambda v: mj.allreduce(v * (rank + 1), "sum")))
    got = batched(jnp.ones((3, 2), jnp.float32) * jnp.arange(3.0)[:, None])
    want = np.arange(3.0)[:, None] * np.ones((3, 2)) * sum(range(1, size + 1))
    np.testing.assert_allclose(np.asarray(got), want)


def test_many_leaves_and_many_calls_in_one_step_keep_one_order(comm):
    """32 leaves of mixed dtypes in one call, and 6 independent calls in one
    jitted function (which XLA may run on several threads), right on every run."""
    rank, size = comm.rank, comm.size
    dtypes = [jnp.float32, jnp.bfloat16, jnp.float16]
    leaves = [jnp.full((k + 1,), (k % 5) + rank, dtypes[k % 3]) for k in range(32)]

    @jax.jit
    def step(tree, values):
        metrics = [mj.allreduce(values[k] * (k + 1), "sum") for k in range(6)]
        return mj.reduce(tree), metrics
    for _ in range(5):
        out, metrics = step(leaves, jnp.full((6,), rank + 1.0, jnp.float32))
        for k, leaf in enumerate(out):
            assert leaf.dtype == leaves[k].dtype
            want = (k % 5) + (size - 1) / 2      # the mean: exact in every dtype here
            assert np.asarray(leaf, np.float64).tolist() == [want] * (k + 1)
        for k, metric in enumerate(metrics):
            assert float(metric) == (k + 1) * size * (size + 1) / 2


def test_a_tree_that_differs_across_ranks_raises_on_every_rank_inside_jit(comm):
    rank = comm.rank
    with Reducer() as reducer:
        differing = jax.jit(lambda t: mj.reduce(t, reducer))
        with pytest.raises(Exception, match=r"StructureMismatchError.*\['w'\]") as raised:
            jax.block_until_ready(differing({"w": jnp.ones(3 + rank, jnp.float32)}))
        assert isinstance(raised.value, RuntimeError)
        # the next call works
        out = differing({"w": jnp.full(2, rank + 1.0, jnp.float32)})
    assert np.asarray(out["w"]).tolist() == [(comm.size + 1) / 2] * 2


def test_flax_optax_step_in_one_jit_matches_one_rank_on_the_full_batch(comm):
    """A flax MLP, optax.chain(mean_gradients(), adam), the whole step one
    jax.jit, 20 steps on each rank's shard of the batch: the parameters of
    one process stepping on the full batch, within float32 rounding, and
    the same bits on every rank."""
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    rank, size = comm.rank, comm.size

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.tanh(nn.Dense(16)(x)))

    model = MLP()
    data = np.random.default_rng(0)
    x_all = data.standard_normal((size * 8, 4)).astype(np.float32)
    y_all = (x_all @ np.array([1.0, -2.0, 0.5, 3.0], np.float32))[:, None]
    params = model.init(jax.random.PRNGKey(0), x_all[:1])

    def loss_fn(p, x, y):
        return jnp.mean((model.apply(p, x) - y) ** 2)

    def train(tx, x, y, steps=20):
        @jax.jit
        def step(p, state):
            grads = jax.grad(loss_fn)(p, x, y)
            updates, state = tx.update(grads, state, p)
            return optax.apply_updates(p, updates), state
        p, state = params, tx.init(params)
        for _ in range(steps):
            p, state = step(p, state)
        return p

    shard = slice(rank * 8, (rank + 1) * 8)
    distributed = train(optax.chain(mj.mean_gradients(), optax.adam(1e-2)),
                        x_all[shard], y_all[shard])
    alone = train(optax.adam(1e-2), x_all, y_all)
    for a, b in zip(jax.tree_util.tree_leaves(distributed), jax.tree_util.tree_leaves(alone)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)
    assert same_on_every_rank(comm, distributed)


def _independent_calls(count, reducer, rank):
    """A jitted function of ``count`` reductions on ``reducer`` that do not
    depend on each other, every input the same shape and dtype (large enough
    for XLA to run them on several threads): only the order of the host
    calls pairs them right."""
    @jax.jit
    def step(offset):
        return [mj.reduce(jnp.full((1024,), i + 100.0 * rank, jnp.float32) + offset, reducer)
                for i in range(count)]
    return step


def _check_pairing(step, runs, size, mean):
    for run in range(runs):
        for i, got in enumerate(step(jnp.float32(run))):
            total = size * (i + run) + 100.0 * size * (size - 1) / 2
            want = total / size if mean else total
            assert np.asarray(got).tolist() == [want] * 1024, f"run {run}, call {i}"


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("count", [8, 16, 64])
def test_independent_reductions_in_one_jit_pair_with_the_same_call_on_every_rank(
        comm, count, mean):
    """Sums or means that do not depend on each other, 20 runs: each result
    is its own call's reduction on every rank (the host calls run in the
    traced order by construction, whatever XLA's threads do)."""
    with Reducer(mean=mean) as reducer:
        _check_pairing(_independent_calls(count, reducer, comm.rank), 20, comm.size, mean)


def test_adversarial_host_call_timing_keeps_every_pairing(comm, monkeypatch):
    """Each rank's host calls sleep a different, random time (0-4 ms, drawn
    per rank): were the calls of one step free to start in any order, the
    ranks would pair different calls; they stay paired by construction."""
    rank, size = comm.rank, comm.size
    delays = np.random.default_rng(rank + 17)
    reduce = Reducer.reduce

    def slowed(self, *args, **kwargs):
        time.sleep(float(delays.uniform(0, 0.004)))
        return reduce(self, *args, **kwargs)
    monkeypatch.setattr(Reducer, "reduce", slowed)
    with Reducer(mean=False) as sums:
        _check_pairing(_independent_calls(16, sums, rank), 5, size, mean=False)


def test_two_dozen_mixed_calls_of_different_shapes_in_one_jit(comm):
    """reduce on a Reducer and allreduce sum/mean/max/min on the default
    helper, 24 calls of different shapes, none depending on another: right
    on the first run and after, the same bits on every rank."""
    rank, size = comm.rank, comm.size
    ops = ["reduce", "sum", "mean", "max", "min"]

    with Reducer() as reducer:
        @jax.jit
        def step(x):
            out = []
            for i in range(24):
                value = jnp.full((256 * (i + 1),), i + rank + 1.0, jnp.float32) * x
                op = ops[i % 5]
                out.append(mj.reduce(value, reducer) if op == "reduce"
                           else mj.allreduce(value, op))
            return out
        for run in range(4):
            out = step(jnp.float32(run + 1))
            for i, got in enumerate(out):
                values = [(i + r + 1.0) * (run + 1) for r in range(size)]
                want = {"reduce": sum(values) / size, "mean": sum(values) / size,
                        "sum": sum(values), "max": max(values), "min": min(values)}[ops[i % 5]]
                np.testing.assert_allclose(np.asarray(got), np.full(256 * (i + 1), want), rtol=1e-6,
                                           err_msg=f"run {run}, call {i} ({ops[i % 5]})")
            assert same_on_every_rank(comm, out)


def test_jax_checkpoint_around_a_reduce_gives_the_step_without_it(comm):
    """jax.checkpoint (remat) around a layer that reduces: the gradient of
    the same step without remat, bit for bit."""
    rank = comm.rank
    x = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)
    w = jnp.full((3, 3), 0.1 * (rank + 1), jnp.float32)
    with Reducer() as reducer:
        def layer(w, x):
            return mj.reduce(jnp.tanh(x @ w), reducer)

        def step(remat):
            f = jax.checkpoint(layer) if remat else layer
            return jax.jit(jax.grad(lambda w: jnp.sum(f(w, x) ** 2)))(w)
        plain, remat = step(False), step(True)
    assert np.asarray(plain).tobytes() == np.asarray(remat).tobytes()

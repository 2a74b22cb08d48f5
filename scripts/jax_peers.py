"""mpigrad.jax.reduce inside jax.jit against what jax users pick on CPU
clusters: jax's own CPU collectives (gloo: ``pmean`` of every leaf under
``shard_map`` across the processes) and, where installed, mpi4jax's
``allreduce`` of every leaf inside jit; the same pytree (a model's gradient
shapes, float32), interleaved rounds, min and median, every result checked.

    mpiexec -n 2 python scripts/jax_peers.py [--layout resnet50] [--rounds 7] [--warmup 10]

jax's gloo needs ``jax.distributed.initialize`` (a coordinator on rank 0's
loopback port, sent over MPI) before any other jax call.
"""

import argparse
import importlib.util
import socket
import statistics
import time

import numpy as np
from mpi4py import MPI

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def coordinator(comm):
    """rank 0's free loopback port, on every rank."""
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return f"127.0.0.1:{comm.bcast(port)}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="resnet50")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=10,
                        help="untimed calls of each case first: a steady state (mpigrad's "
                             "Reducer times its two node sums over its first 8 calls, "
                             "then keeps the faster)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    jax.distributed.initialize(coordinator_address=coordinator(comm),
                               num_processes=comm.size, process_id=comm.rank)
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import mpigrad
    import mpigrad.jax as mj
    from mpigrad.bench.layouts import load_layout

    shapes = load_layout(args.layout)
    mean = (comm.size + 1) / 2                     # every leaf holds rank + 1
    tree = [jnp.full(s, comm.rank + 1.0, jnp.float32) for s in shapes]
    reducer = mpigrad.Reducer()
    ours = jax.jit(lambda t: mj.reduce(t, reducer))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    spread = [jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec("x")), np.full((1, *s), comm.rank + 1.0, np.float32))
        for s in shapes]
    gloo = jax.jit(jax.shard_map(lambda t: [jax.lax.pmean(x, "x") for x in t], mesh=mesh,
                                 in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x")))
    cases = {"mpigrad.jax.reduce in jit": lambda: ours(tree),
             "jax gloo pmean under shard_map": lambda: gloo(spread)}
    firsts = {"mpigrad.jax.reduce in jit": lambda out: out[0],
              "jax gloo pmean under shard_map": lambda out: out[0].addressable_shards[0].data}
    if importlib.util.find_spec("mpi4jax") is not None:
        import mpi4jax
        per_leaf = jax.jit(lambda t: [mpi4jax.allreduce(x, op=MPI.SUM, comm=comm) / comm.size
                                      for x in t])
        cases["mpi4jax allreduce per leaf in jit"] = lambda: per_leaf(tree)
        firsts["mpi4jax allreduce per leaf in jit"] = lambda out: out[0]
    right = {}
    for name, case in cases.items():
        first = np.asarray(firsts[name](jax.block_until_ready(case())))
        right[name] = comm.allreduce(bool(np.all(first == mean)), op=MPI.LAND)
        for _ in range(args.warmup):
            jax.block_until_ready(case())
    seen = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            comm.Barrier()
            start = time.perf_counter()
            jax.block_until_ready(case())
            seen[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    reducer.free()
    if comm.rank == 0:
        print(f"{args.layout}: {len(shapes)} float32 leaves, {comm.size} ranks; ms, min / "
              f"median of {args.rounds} interleaved rounds; x: min against mpigrad's")
        base = min(seen["mpigrad.jax.reduce in jit"])
        for name, times in seen.items():
            print(f"  {name:34s} {min(times) * 1e3:8.1f} / {statistics.median(times) * 1e3:8.1f}"
                  f"   {min(times) / base:5.2f}x   right: {right[name]}")
        if "mpi4jax allreduce per leaf in jit" not in seen:
            print("  mpi4jax not installed: its case is not timed")


if __name__ == "__main__":
    main()

"""Survive a lost rank: a numpy trainer whose rank 2 dies at a known step; the
survivors shrink, restore the last committed state, re-shard the data and
finish every step with identical parameters.

    mpiexec --with-ft ulfm --mca btl tcp,self --mca btl_tcp_if_include lo \\
        -n 3 python examples/elastic.py

(Open MPI 5 with ULFM; as root add --allow-run-as-root.) Each survivor
prints the time from the death to its first step on the shrunk
communicator, and exits non-zero if the survivors' parameters differ. With
the Open MPI 5.0.11 wheel, about one job in ten does not end by itself after
the survivors are done (they are in its MPI_Finalize after a lost rank).
"""

import argparse
import os
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

import mpigrad

FEATURES, SAMPLES = 16, 3000


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, FEATURES))
    return x, x @ np.linspace(-1, 1, FEATURES) + 0.1 * rng.standard_normal(SAMPLES)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--die-at", type=int, default=10, help="the step at which rank 2 dies")
    args = p.parse_args(argv)
    world = MPI.COMM_WORLD
    death_file = world.bcast(tempfile.mktemp(prefix="mpigrad-elastic-") if world.rank == 0
                             else None)
    x, y = data()
    reducer = mpigrad.Reducer(on_failure="shrink")
    state = mpigrad.elastic.State({"w": np.zeros(FEATURES), "step": 0}, reducer)
    shard = {}
    recovered = {}

    def reshard(state=None, lost=None):
        comm = reducer.comm
        shard["x"], shard["y"] = x[comm.rank::comm.size], y[comm.rank::comm.size]
        if lost is not None:
            recovered["lost"] = lost

    reshard()
    state.on_reset(reshard)

    def train(state):
        while state.tree["step"] < args.steps:
            if world.rank == 2 and state.tree["step"] == args.die_at:
                with open(death_file, "w") as f:
                    f.write(repr(time.time()))
                os._exit(1)                          # the rank is lost, no goodbye
            w = state.tree["w"]
            residual = shard["x"] @ w - shard["y"]
            grad = shard["x"].T @ residual / len(y)
            (grad,) = reducer.reduce([grad * reducer.comm.size])    # mean of per-shard sums
            w -= 0.5 * grad
            state.tree["step"] += 1
            state.commit()
            if "lost" in recovered and "first_step" not in recovered:
                recovered["first_step"] = time.time()

    mpigrad.elastic.run(train, state)
    comm = reducer.comm
    weights = comm.allgather(state.tree["w"])
    same = all(np.array_equal(w, weights[0]) for w in weights)
    if "lost" in recovered:
        with open(death_file) as f:
            died = float(f.read())
        print(f"rank {world.rank}: lost ranks {list(recovered['lost'].failed)}, "
              f"{comm.size} left; first step on the shrunk communicator "
              f"{recovered['first_step'] - died:.3f} s after the death; "
              f"{state.tree['step']} steps done; parameters identical on the survivors: {same}",
              flush=True)
    comm.Barrier()
    if comm.rank == 0 and os.path.exists(death_file):
        os.unlink(death_file)
    reducer.free()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

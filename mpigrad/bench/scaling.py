"""``mpigrad-bench --scaling 2,4,8,16,32``: what each rank pays as the rank count grows.

For each rank count p, one job (``mpiexec -n p``, or p/ppn nodes of namespaces with
``--ppn``) runs ``probe`` on every rank: a Reducer constructed (timed), one reduce of a
small layout counted (``mpigrad.statistics()``: MPI operations, agreements) and checked
against the mean known from p, three live Reducers at exit (its time, its notices), and
the rank's peak memory. Counts are exact; times are this machine's, oversubscribed past
its cores, and labelled so.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["main", "probe", "run_scaling", "render_scaling"]

#: the probe's gradients: 40 tensors, 2.4 MB of float32 (many small ones, as a model has)
SHAPES = [(256, 64)] * 20 + [(4096,)] * 10 + [(128, 256)] * 10
#: live Reducers at exit (the issue's measurement: a trainer, its metrics, a helper)
REDUCERS = 3
#: the probe's Reducers, live until the program ends (one collected before tells every
#: peer at once, as free() does)
_LIVE: List[Any] = []


def probe(out: str) -> None:
    """One rank's figures, written to ``out``/rank<r>.json after its exit's notices."""
    import atexit
    import resource

    record: Dict[str, Any] = {}

    def written() -> None:         # registered before mpigrad's exit hook: runs after it
        from mpigrad import statistics
        record["exit_end"] = time.time()
        record["exit_notices"] = statistics().notices - record["notices_before_exit"]
        with open(os.path.join(out, f"rank{record['rank']}.json"), "w") as f:
            json.dump(record, f)

    atexit.register(written)
    import numpy as np
    from mpi4py import MPI

    import mpigrad
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    comm.Barrier()
    start = time.perf_counter()
    reducers = [mpigrad.Reducer()]
    record["construct_s"] = time.perf_counter() - start
    reducers += [mpigrad.Reducer() for _ in range(REDUCERS - 1)]
    grads = [np.full(shape, rank + 1, np.float32) for shape in SHAPES]
    reducers[0].reduce(grads)                      # warm: plans, buffers, segments
    before = mpigrad.statistics()
    start = time.perf_counter()
    summed = reducers[0].reduce(grads)
    record["call_s"] = time.perf_counter() - start
    cost = mpigrad.statistics() - before
    expected = np.float32((size + 1) / 2)          # the mean of 1..p, exact in float32
    record["verified"] = all(bool(np.all(g == expected)) for g in summed)
    for reducer in reducers[1:]:
        reducer.reduce(grads[:1])
    _LIVE.extend(reducers)
    record.update(rank=rank, size=size, operations=cost.operations,
                  agreements=cost.agreements, notices_before_exit=mpigrad.statistics().notices,
                  peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    atexit.register(lambda: record.__setitem__("exit_start", time.time()))  # runs first


def _launch(ranks: int, ppn: Optional[int], out: str, limit: float) -> Dict[str, Any]:
    """Run the probe on ``ranks`` ranks; its ranks' records and how it was placed."""
    argv = [sys.executable, "-m", "mpigrad.bench.scaling", "--probe", out]
    mpiexec = shutil.which("mpiexec") or "mpiexec"
    env = dict(os.environ)
    if ppn is not None and ranks % ppn == 0 and ranks // ppn >= 2:
        from .cluster import cluster
        with cluster(ranks // ppn) as nodes:
            env.update(nodes.environment(ppn))
            where = f"{ranks // ppn} nodes x {ppn}"
            code = subprocess.run(nodes.nodes[0].enter(nodes.mpiexec(ppn, mpiexec) + argv),
                                  env=env, timeout=limit, check=False).returncode
    else:
        where = f"1 node x {ranks}"
        code = subprocess.run([mpiexec, "-n", str(ranks), *argv], env=env, timeout=limit,
                              check=False).returncode
    records = []
    for rank in range(ranks):
        path = os.path.join(out, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                records.append(json.load(f))
    return {"ranks": ranks, "where": where, "code": code, "records": records}


def run_scaling(counts: Sequence[int], ppn: Optional[int], limit: float = 900.0
                ) -> List[Dict[str, Any]]:
    """One row per rank count: the per-rank figures (max, or mean and max)."""
    rows = []
    for ranks in counts:
        with tempfile.TemporaryDirectory(prefix="mpigrad-scaling-") as out:
            started = time.monotonic()
            job = _launch(ranks, ppn, out, limit)
            wall = time.monotonic() - started
        got = job["records"]
        complete = job["code"] == 0 and len(got) == ranks
        notices = [r["exit_notices"] / REDUCERS for r in got]

        def most(figure: Callable[[Dict[str, Any]], float], none: float = float("nan")
                 ) -> float:
            """The largest of every rank's ``figure`` (``none`` without records)."""
            return max(map(figure, got), default=none)

        rows.append({
            "ranks": ranks, "where": job["where"], "complete": complete,
            "verified": complete and all(r["verified"] for r in got),
            "construct_s": most(lambda r: r["construct_s"]),
            "operations": most(lambda r: r["operations"], 0),
            "agreements": most(lambda r: r["agreements"], 0),
            "call_ms": 1e3 * most(lambda r: r["call_s"]),
            "exit_ms": 1e3 * most(lambda r: r["exit_end"] - r["exit_start"]),
            "notices_mean": sum(notices) / len(notices) if notices else float("nan"),
            "notices_max": max(notices, default=float("nan")),
            "rss_mb": most(lambda r: r["peak_rss_mb"]),
            "job_s": wall})
    return rows


def render_scaling(rows: List[Dict[str, Any]]) -> str:
    cores = os.cpu_count() or 1
    megabytes = sum(math.prod(shape) for shape in SHAPES) * 4 / 1e6
    lines = [f"scaling: {len(SHAPES)} float32 tensors ({megabytes:.1f} MB) per call, "
             f"{REDUCERS} live Reducers at exit; counts per rank are exact, times are of "
             f"this machine's {cores} cores (oversubscribed where ranks > {cores})",
             f"{'ranks':>5} {'placed':>12} {'construct s':>11} {'MPI ops/call':>12} "
             f"{'agreements':>10} {'call ms':>8} {'exit ms':>7} {'exit notices/Reducer':>20} "
             f"{'peak MB':>8} {'job s':>6} verified"]
    for r in rows:
        notices = f"{r['notices_mean']:.1f} mean, {r['notices_max']:.0f} max"
        lines.append(f"{r['ranks']:>5} {r['where']:>12} {r['construct_s']:>11.2f} "
                     f"{r['operations']:>12} {r['agreements']:>10} {r['call_ms']:>8.1f} "
                     f"{r['exit_ms']:>7.1f} {notices:>20} {r['rss_mb']:>8.0f} "
                     f"{r['job_s']:>6.1f} {'yes' if r['verified'] else 'NO'}")
    return "\n".join(lines)


def main(counts: Sequence[int], ppn: Optional[int]) -> int:
    rows = run_scaling(counts, ppn)
    print(render_scaling(rows))
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        probe(sys.argv[2])

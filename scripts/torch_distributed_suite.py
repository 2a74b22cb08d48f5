"""torch's own distributed test file on a backend, as torch ran it for its MPI
backend: every rank of an mpiexec job runs each test of
``DistributedTest._DistTestBase`` (torch/testing/_internal/distributed/
distributed_test.py, shipped in the torch wheel) in turn, in one process group.

    mpiexec -n 2 python scripts/torch_distributed_suite.py --backend mpigrad --expect gloo
    mpiexec -n 3 python scripts/torch_distributed_suite.py --backend gloo --expect gloo

``--expect`` is the BACKEND the file is read with (its skips and expectations:
"gloo", or "mpi" for an MPI backend's); ``--backend`` is the group the tests
run on. Each rank appends one JSON line per test to ``--out`` (rank 0 sums up:
the counts, then every test that did not pass on some rank, with its first
error line). After a test that failed on any rank the default group is made
again, so one failure does not take the rest with it.
"""

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
import unittest
from datetime import timedelta

from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["mpigrad", "gloo"], default="mpigrad")
    parser.add_argument("--expect", choices=["gloo", "mpi"], default="gloo")
    parser.add_argument("--only", default="", help="run the tests whose name contains this")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="the group's timeout, seconds (default 60)")
    parser.add_argument("--out", default="torch-distributed-suite.jsonl")
    return parser.parse_args()


def _shared_temp_dir() -> str:
    """A directory every rank uses (the file's Barrier.sync keeps its files there)."""
    path = tempfile.mkdtemp(prefix="torch-dist-") if WORLD.rank == 0 else None
    path = WORLD.bcast(path)
    if WORLD.rank == 0:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(path, sub), exist_ok=True)
    WORLD.Barrier()
    return path


def _init(backend: str, seconds: float) -> None:
    import torch.distributed as dist
    timeout = timedelta(seconds=seconds)
    if backend == "mpigrad":
        import mpigrad.torch  # noqa: F401  (registers the backend)
        dist.init_process_group("mpigrad", timeout=timeout)
        return
    port = None
    if WORLD.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{WORLD.bcast(port)}",
                            rank=WORLD.rank, world_size=WORLD.size, timeout=timeout)


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def main() -> int:
    args = _args()
    temp = _shared_temp_dir()
    os.environ.update(BACKEND=args.expect, WORLD_SIZE=str(WORLD.size), TEMP_DIR=temp,
                      PYTORCH_PRINT_REPRO_ON_FAILURE="0",
                      MASTER_ADDR="127.0.0.1")
    os.environ.pop("MASTER_PORT", None)
    if args.backend == "mpigrad":
        os.environ.pop("MASTER_ADDR")
    import torch.distributed as dist
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed import distributed_test as suite

    class OnBackend(TestCase, suite.DistributedTest._DistTestBase):
        rank = WORLD.rank
        world_size = WORLD.size

    from torch.testing._internal.common_distributed import TEST_SKIPS
    skips = {f"SystemExit: {s.exit_code}": s.message for s in TEST_SKIPS.values()}
    _init(args.backend, args.timeout)
    names = [n for n in unittest.TestLoader().getTestCaseNames(OnBackend) if args.only in n]
    out = open(f"{args.out}.rank{WORLD.rank}", "w")
    began = time.monotonic()
    for name in names:
        WORLD.Barrier()
        result = unittest.TestResult()
        start = time.monotonic()
        try:
            OnBackend(name).run(result)
            outcome, why = "passed", ""
            if result.skipped:
                outcome, why = "skipped", result.skipped[0][1]
            elif result.failures or result.errors:
                outcome = "failed"
                why = _first_line((result.failures or result.errors)[0][1])
                if why in skips:         # the file's skips by exit code (world size, GPUs)
                    outcome, why = "skipped", skips[why]
        except BaseException:          # the harness's own error: recorded, not fatal
            outcome, why = "failed", _first_line(traceback.format_exc())
        outcomes = WORLD.allgather(outcome)
        out.write(json.dumps({"test": name, "rank": WORLD.rank, "outcome": outcome,
                              "why": why, "seconds": round(time.monotonic() - start, 2)}) + "\n")
        out.flush()
        if "failed" in outcomes:       # a fresh default group for the next test
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except BaseException:
                pass
            WORLD.Barrier()
            _init(args.backend, args.timeout)
    out.close()
    WORLD.Barrier()
    if WORLD.rank == 0:
        _sum_up(args, len(names), time.monotonic() - began)
        shutil.rmtree(temp, ignore_errors=True)
    return 0


def _sum_up(args: argparse.Namespace, count: int, seconds: float) -> None:
    """Counts over the tests (a test passed if it passed on every rank, was
    skipped if skipped on any), then each test that failed, with why."""
    rows = []
    for rank in range(WORLD.size):
        with open(f"{args.out}.rank{rank}") as f:
            rows += [json.loads(line) for line in f]
    by_test: dict = {}
    for row in rows:
        by_test.setdefault(row["test"], []).append(row)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed = []
    for test, runs in by_test.items():
        kinds = {r["outcome"] for r in runs}
        kind = "failed" if "failed" in kinds else "skipped" if "skipped" in kinds else "passed"
        counts[kind] += 1
        if kind == "failed":
            why = next(r["why"] for r in runs if r["outcome"] == "failed")
            failed.append((test, why))
    ran = counts["passed"] + counts["failed"]
    with open(args.out, "w") as f:
        json.dump({"backend": args.backend, "expect": args.expect, "ranks": WORLD.size,
                   "counts": counts, "failed": failed, "seconds": round(seconds)}, f, indent=1)
    print(f"{args.backend} with {args.expect}'s expectations at {WORLD.size} ranks: "
          f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
          f"of {count} ({100 * counts['passed'] / max(ran, 1):.1f}% of those run) "
          f"in {seconds:.0f} s")
    for test, why in failed:
        print(f"  FAILED {test}: {why}")


if __name__ == "__main__":
    sys.exit(main())

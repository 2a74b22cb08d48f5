"""The cluster of namespaces (mpigrad.bench.cluster): separate hosts to MPI, a private
/dev/shm per node, traffic between nodes held to the link's rate, and nothing left behind
however its command ends. Skipped, naming what is missing, where namespaces cannot be made; in CI
(CI=true) that fails instead."""

import os
import signal
import subprocess
import sys
import time

import pytest

from mpigrad.bench import cluster

MISSING = cluster.missing()


@pytest.fixture
def needs_a_cluster():
    if MISSING is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs the cluster tests, but this machine lacks {MISSING}")
        pytest.skip(f"a cluster on this machine needs {MISSING}")


def leftovers():
    """Interfaces and holders of any cluster still present on this machine."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    holders = subprocess.run(["pgrep", "-f", "^unshare --net --uts"], capture_output=True,
                             text=True).stdout.split()
    return [line.split(":")[1].strip() for line in links.splitlines() if ": mgc" in line], holders


def run_on_cluster(*args, limit=60):
    return subprocess.run([sys.executable, "-m", "mpigrad.bench.cluster", *args],
                          capture_output=True, text=True, timeout=limit)


SCRIPT = """
import os, socket, time
import numpy as np
from mpi4py import MPI
world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED)
if node.rank == 0:
    open(f"/dev/shm/mark-{socket.gethostname()}", "w").close()
node.Barrier()
marks = ",".join(sorted(name for name in os.listdir("/dev/shm") if name.startswith("mark-")))
seen = world.gather(f"{socket.gethostname()} {node.size} {marks}")
if world.rank == 0:
    print("\\n".join(f"rank {line}" for line in seen), flush=True)
# 100 Mbit from the first rank of node 0 to the first of node 1 (world ranks 0 and 2)
data = np.ones(12_500_000 // 8)
world.Barrier()
began = time.perf_counter()
if world.rank == 0:
    world.Send(data, 2)
    world.Recv(data[:1], 2)
    print("seconds", time.perf_counter() - began, flush=True)
elif world.rank == 2:
    world.Recv(data, 0)
    world.Send(data[:1], 0)
"""


def test_link_rates_are_read_as_tc_writes_them():
    assert cluster.link_bits_per_second("2gbit") == 2e9
    assert cluster.link_bits_per_second("500Mbit") == 5e8
    with pytest.raises(ValueError, match=r"expected a number and one of .* got '2 GB/s'"):
        cluster.link_bits_per_second("2 GB/s")


def test_mpi_sees_two_hosts_with_their_own_shared_memory_on_a_link_held_to_its_rate(
        tmp_path, needs_a_cluster):
    script = tmp_path / "where.py"
    script.write_text(SCRIPT)
    done = run_on_cluster("--nodes", "2", "--ppn", "2", "--link", "200mbit", "--",
                          sys.executable, str(script))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("rank")]
    assert lines == [["node0", "2", "mark-node0"]] * 2 + [["node1", "2", "mark-node1"]] * 2
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("mark-")]
    seconds = float(done.stdout.split("seconds")[1].split()[0])
    assert seconds > 0.4, f"100 Mbit crossed a 200 Mbit/s link in {seconds:.3f} s"
    assert leftovers() == ([], [])


def test_nodes_of_unequal_sizes_hold_consecutive_ranks(needs_a_cluster):
    done = run_on_cluster("--ppn", "3,1,2", "--", sys.executable, "-c",
                          "import os, socket; from mpi4py import MPI; os.write(1, "
                          "f'rank {MPI.COMM_WORLD.rank} {socket.gethostname()}\\n'.encode())")
    assert done.returncode == 0, done.stdout + done.stderr
    hosts = dict(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("rank"))
    assert [hosts[str(r)] for r in range(6)] == ["node0"] * 3 + ["node1"] + ["node2"] * 2
    assert leftovers() == ([], [])
    wrong = run_on_cluster("--nodes", "2", "--ppn", "3,1,2", "--", "true")
    assert wrong.returncode == 2 and "--ppn 3,1,2 places 3 nodes: got --nodes 2" in wrong.stderr


def test_a_failed_command_and_a_stopped_one_leave_nothing_behind(needs_a_cluster):
    done = run_on_cluster("--nodes", "3", "--ppn", "1", "--", sys.executable, "-c",
                          "import sys; sys.exit(3)")
    assert done.returncode != 0
    assert leftovers() == ([], [])
    job = subprocess.Popen([sys.executable, "-m", "mpigrad.bench.cluster", "--nodes", "2",
                            "--ppn", "1", "--", "sleep", "60"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not leftovers()[1] and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 130 and "torn down" in err, err
    assert leftovers() == ([], [])

"""Node memory without MPI: segments of dead processes are found and removed."""

import os
import subprocess
import sys

from mpigrad._backends import node_memory


def test_segments_of_dead_processes_are_removed_and_others_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(node_memory, "SEGMENT_DIR", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    names = {"orphan": f"mpigrad-{dead}-00ff", "live": f"mpigrad-{os.getpid()}-00ff",
             "foreign": f"other-{dead}-00ff", "unnamed": "mpigrad-notapid-00ff"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    assert node_memory.remove_orphans() == 1
    assert sorted(os.listdir(tmp_path)) == sorted(v for k, v in names.items() if k != "orphan")

"""scripts/test_steps.sh, the steps of the test command: what a step leaves
running is ended and counted, a stop ends every process the command started
(those whose parent died first too), and both still sum up what ran; a
failed step's failing tests are said again just before the summary; ranks whose
counts differ are each counted."""

import os
import signal
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: a step's command: it passes and leaves a process of its own session behind,
#: holding the step's output open (its pid in $1), as an mpiexec whose pytest
#: worker was killed does; with "wait", it then waits
LEAVES = """(setsid sleep 300 & echo $! > "$1")    # its parent gone: out of the process tree
echo "3 passed"
[ "${2:-}" != wait ] || sleep 300
"""

#: a step's command that leaves 100 processes, each exec'ing 100 times before it
#: sleeps (their pids in $1): a process in the middle of an exec shows no
#: environment for a moment, so one scan for the step's mark misses some of them
LEAVES_EXECING = """chain=$(printf 'env %.0s' {1..100})
for i in {1..100}; do (setsid $chain sleep 300 & echo $! >> "$1"); done
echo "3 passed"
"""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:        # a zombie has ended
        return stat.read().split(")")[-1].split()[0] != "Z"


def _pid(path):
    deadline = time.monotonic() + 60
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, "the step's process never started"
        time.sleep(0.1)
    return int(path.read_text())


def _shell(script, tmp):
    """bash running ``script`` with the steps, as scripts/test.sh does (its shell
    options too), its temporary files in ``tmp``"""
    return subprocess.Popen(["bash", "-c",
                             f"set -euo pipefail; source scripts/test_steps.sh; {script}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env=dict(os.environ, TMPDIR=str(tmp)))


def _output(shell):
    """what ``shell`` printed once it exits; past 120 s its process group is killed
    and the test fails with what it had printed"""
    try:
        return shell.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        os.killpg(shell.pid, signal.SIGKILL)
        pytest.fail(f"the steps ran past 120 s; they printed:\n{shell.communicate(timeout=30)[0]}")


@pytest.fixture
def leaves(tmp_path):
    (tmp_path / "leaves.sh").write_text(LEAVES)
    return tmp_path / "leaves.sh"


@pytest.fixture
def tmp(tmp_path):
    """the steps' TMPDIR, left empty (a step's log and count files removed)"""
    (tmp_path / "tmp").mkdir()
    yield tmp_path / "tmp"
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.fixture
def pidfile(tmp_path):
    path = tmp_path / "pid"
    yield path
    if path.exists() and path.read_text().strip() and _alive(int(path.read_text())):
        os.kill(int(path.read_text()), signal.SIGKILL)


def test_what_a_step_leaves_running_is_ended_and_counted(leaves, pidfile, tmp):
    shell = _shell(f"step 'leaves one' bash {leaves} {pidfile}; summary; exit $FAILED", tmp)
    out = _output(shell)
    assert shell.returncode == 0, out
    assert "leaves one: 3 passed, 1 processes left running (ended)" in out, out
    assert not _alive(_pid(pidfile)), out


def test_processes_in_the_middle_of_an_exec_are_each_ended_and_counted(tmp_path, tmp):
    """The step scans for its mark until three scans find none: with one scan, a
    left process it missed held the step's output open (a CI run's step hung on
    its sleep 300) and the count was short."""
    (tmp_path / "leaves.sh").write_text(LEAVES_EXECING)
    pids = tmp_path / "pids"
    shell = _shell(f"step 'leaves 100' bash {tmp_path / 'leaves.sh'} {pids}; summary; "
                   f"exit $FAILED", tmp)
    try:
        out = _output(shell)
    finally:
        started = pids.read_text().split() if pids.exists() else []   # (none: it failed first)
        left = [pid for pid in map(int, started) if _alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert shell.returncode == 0, out
    assert "leaves 100: 3 passed, 100 processes left running (ended)" in out, out
    assert left == [] and len(started) == 100, out


def test_a_stop_ends_every_process_the_steps_started_and_sums_up(leaves, pidfile, tmp):
    shell = _shell(f"trap stopped INT TERM; step 'first' true; "
                   f"step 'waits' bash {leaves} {pidfile} wait; echo not reached", tmp)
    pid = _pid(pidfile)
    shell.send_signal(signal.SIGTERM)
    out = _output(shell)
    assert shell.returncode == 130, out
    assert "== stopped" in out and "first: done" in out and "not reached" not in out, out
    assert not _alive(pid), out


def test_a_stop_between_steps_still_sums_up(pidfile, tmp):
    shell = _shell(f"trap stopped INT TERM; step 'first' true; "
                   f"sleep 300 & echo $! > {pidfile}; wait $!; echo not reached", tmp)
    pid = _pid(pidfile)
    shell.send_signal(signal.SIGTERM)
    out = _output(shell)
    assert shell.returncode == 130, out
    assert "== stopped" in out and "first: done" in out and "not reached" not in out, out
    assert not _alive(pid), out


def test_a_failed_steps_failures_are_said_again_before_the_summary(tmp):
    """A CI log is often read from its end: each failed step's pytest FAILED and
    ERROR lines (once each, though every rank prints them), or its last lines
    where it printed none (a step ended by its timeout), or that it printed
    nothing, come just before the
    summary, which stays the last line; a passed step adds nothing."""
    fails = ("echo 'FAILED tests/t.py::a - boom'; echo 'FAILED tests/t.py::a - boom'; "
             "echo 'ERROR tests/t.py::b'; echo '1 failed, 1 error'; exit 1")
    shell = _shell(f"step 'passes' echo '3 passed'; step 'fails' bash -c \"{fails}\"; "
                   f"step 'ends' bash -c 'echo first; echo last words; exit 124'; "
                   f"step 'silent' false; summary; exit $FAILED", tmp)
    out = _output(shell)
    assert shell.returncode == 1, out
    lines = out.splitlines()
    said = lines.index("== what the failed steps said last")
    assert lines[said + 1:] == ["fails: FAILED tests/t.py::a - boom", "fails: ERROR tests/t.py::b",
                                "ends: first", "ends: last words",
                                "silent: (it printed nothing)", lines[-1]], out
    assert lines[-1].startswith("== summary") and "passes: 3 passed" in lines[-1], out


def test_ranks_whose_counts_differ_are_each_summed_up(tmp):
    """Every rank prints pytest's count line; where they differ (a rank alone in a
    split skips what needs two), each different line is in the summary once."""
    ranks = ("echo '1304 passed, 40 skipped, 716 deselected in 80.1s'; "
             "echo '1326 passed, 18 skipped, 716 deselected in 80.2s'; "
             "echo '1304 passed, 40 skipped, 716 deselected in 80.3s'")
    shell = _shell(f"step 'ranks' bash -c \"{ranks}\"; step 'alike' bash -c "
                   f"'echo 5 passed in 1s; echo 5 passed in 1s'; summary", tmp)
    out = _output(shell)
    assert shell.returncode == 0, out
    summary = out.splitlines()[-1]
    assert ("ranks: 1304 passed, 40 skipped, 716 deselected / 1326 passed, 18 skipped, "
            "716 deselected (") in summary, out
    assert "alike: 5 passed (" in summary, out

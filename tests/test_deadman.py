"""The deadlines that end a process stuck inside a library (mpigrad._comm.deadman):
they must work while the stuck thread holds the GIL, where no Python code runs."""

import signal
import subprocess
import sys
import textwrap
import time

STUCK_IN_C = "import ctypes; ctypes.PyDLL(None).sleep(60)    # blocked in C, the GIL held"


def run(body, limit=30):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True,
                          text=True, timeout=limit)
    return proc.returncode, proc.stderr, time.monotonic() - start


def test_a_bounded_block_stuck_in_c_ends_the_process_with_its_stacks():
    code, err, took = run(f"""
        from mpigrad._comm.deadman import bounded
        with bounded(1.0):
            {STUCK_IN_C}
        """)
    assert code == 1 and took < 20
    assert "Timeout (0:00:01)!" in err and "<string>" in err      # the stuck frame


def test_a_bounded_block_that_finishes_leaves_the_process_alone():
    code, err, _ = run("""
        import time
        from mpigrad._comm.deadman import bounded
        with bounded(1.0):
            pass
        time.sleep(2)
        print("alive")
        """)
    assert code == 0, err


def test_finalize_stuck_after_a_lost_rank_ends_by_the_kernel():
    # registered before bound_finalize's handler, so it runs after it (LIFO),
    # where mpi4py's MPI_Finalize would
    code, _, took = run(f"""
        import atexit
        from mpigrad._comm import deadman
        atexit.register(lambda: exec({STUCK_IN_C.split('#')[0].strip()!r}))
        deadman.FINALIZE_GRACE = 1
        deadman.bound_finalize()
        """)
    assert code == -signal.SIGALRM and took < 20

"""Shared helpers: rank-dependent gradients and their numpy reference."""

import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from mpigrad._base.dtypes import bfloat16, wire_dtype

ALL_DTYPES = [np.dtype(np.float16), bfloat16, np.dtype(np.float32),
              np.dtype(np.float64), np.dtype(np.complex64), np.dtype(np.complex128)]


def pattern(shape, dtype, rank, seed=0):
    """Small integers depending on rank and seed: exact in every dtype, and so
    are their sums over a few ranks, whatever order MPI adds them in."""
    size = math.prod(shape)
    base = (np.arange(size, dtype=np.int64) * (seed + 1) + 3 * rank + seed) % 11 - 5
    values = base.astype(np.float64)
    if np.dtype(dtype).kind == "c":
        values = values + 1j * ((base * 7 + rank) % 5 - 2)
    return values.reshape(shape).astype(dtype)


def expected(shape, dtype, size, seed=0, mean=True, degree=None):
    """The numpy reference of reducing pattern(shape, dtype, r, seed) over ``size`` ranks."""
    wire = wire_dtype(dtype)
    total = sum(pattern(shape, dtype, r, seed).astype(wire) for r in range(size))
    total = np.asarray(total, dtype=wire).reshape(shape)
    degree = size if degree is None else degree
    if mean and degree != 1:
        total = total * wire.type(1.0 / degree)
    return np.asarray(total).astype(dtype)


def assert_bitwise_equal(got, want, label=""):
    assert got.dtype == want.dtype, f"{label}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    g = np.ascontiguousarray(got).view(np.uint8)
    w = np.ascontiguousarray(want).view(np.uint8)
    assert np.array_equal(g, w), f"{label}: values differ\n got {got!r}\nwant {want!r}"


def assert_same_on_all_ranks(comm, arrays):
    """Every rank holds bitwise the same arrays as rank 0."""
    blobs = [np.ascontiguousarray(a).tobytes() for a in arrays]
    root = comm.bcast(blobs, root=0)
    diff = [i for i, (a, b) in enumerate(zip(blobs, root)) if a != b]
    all_diff = comm.allgather(diff)
    assert not any(all_diff), f"results differ from rank 0 at positions {all_diff}"


def sparse_rows(rank, seed, rows, k, width_shape, dtype, index_dtype=np.int64):
    """A rank's RowSparse pieces: k indices (duplicates likely) and small-integer values."""
    rng = np.random.default_rng(1000 * seed + rank)
    indices = rng.integers(0, rows, size=k).astype(index_dtype)
    values = pattern((k, *width_shape), dtype, rank, seed)
    return indices, values


#: seconds a test's pytest timeout runs past the limit of its own jobs
_PAST_THE_JOBS = 60


def outlasting(seconds):
    """pytest-timeout's mark for a test whose own jobs or builds are bounded at
    ``seconds``, past setup.cfg's 120 s: that limit, not pytest-timeout, ends a
    hung one (run_until reports what the job printed)."""
    import pytest
    return pytest.mark.timeout(seconds + _PAST_THE_JOBS)


def mpiexec_path():
    """The mpiexec beside this Python (the MPI wheel's) or on PATH; None if absent."""
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                        + os.environ.get("PATH", ""))


# -- data that exposes summation order ---------------------------------------
#: binary exponent range of ``noisy`` values per dtype: wide, yet every sum
#: over a few ranks stays finite and (but for float16's subnormals) normal
_EXPONENTS = {"float16": 8, "bfloat16": 40, "float32": 40, "float64": 200,
              "complex64": 40, "complex128": 200}


def noisy(shape, dtype, rank, seed=0):
    """Non-integer values over a wide exponent range: their float sums depend
    on the order of the additions, so they show where order is not fixed."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng([seed, rank, 7])
    span = _EXPONENTS[dtype.name]

    def part():
        return rng.uniform(-1, 1, shape) * np.exp2(rng.integers(-span, span + 1, shape))
    values = part() + 1j * part() if dtype.kind == "c" else part()
    return np.asarray(values).astype(dtype)


def unit_roundoff(dtype):
    """Half the machine epsilon of ``dtype`` (of its real part for complex)."""
    dtype = np.dtype(dtype)
    if dtype == bfloat16:
        return 2.0 ** -8
    return float(np.finfo(dtype).eps) / 2


def smallest_subnormal(dtype):
    dtype = np.dtype(dtype)
    if dtype == bfloat16:
        return 2.0 ** -133
    return float(np.finfo(dtype).smallest_subnormal)


def reference(inputs, dtype, mean=True, degree=None):
    """(float64 or complex128 result, tolerance per element) of reducing
    ``inputs`` (one array per rank, of ``dtype``) as mpigrad does.

    The tolerance is derived, not chosen: the p-1 additions in the wire dtype
    and in the float64 reference (first-order bound (p-1) u sum|x|), the
    mean's two roundings (1/degree, then the product: 2 u_wire |r|) and the
    cast back to ``dtype`` (u_out |r|, plus half a subnormal step), for the
    real and imaginary parts alike.
    """
    dtype, wire = np.dtype(dtype), wire_dtype(dtype)
    exact = np.complex128 if dtype.kind == "c" else np.float64
    xs = [np.asarray(x).astype(exact) for x in inputs]
    total = sum(xs[1:], xs[0].copy())
    degree = len(inputs) if degree is None else degree
    scale = 1.0 / degree if mean and degree != 1 else 1.0
    result = total * scale
    u_wire, u_64, u_out = unit_roundoff(wire), unit_roundoff(np.float64), unit_roundoff(dtype)
    p = len(inputs)

    def bound(magnitudes, value):
        tol = (p - 1) * (u_wire + u_64) * magnitudes * scale
        if scale != 1.0:
            tol += 2 * u_wire * np.abs(value)
        if dtype != wire:
            tol += u_out * np.abs(value) + smallest_subnormal(dtype) / 2
        return tol * 1.001 + 0.0

    if dtype.kind == "c":
        tol = (bound(sum(np.abs(x.real) for x in xs), result.real)
               + 1j * bound(sum(np.abs(x.imag) for x in xs), result.imag))
    else:
        tol = bound(sum(np.abs(x) for x in xs), result)
    return result, tol


def assert_within(got, want, tol, label=""):
    """Every element of ``got`` within ``tol`` of the float64 ``want`` (real
    and imaginary parts separately for complex)."""
    got = np.asarray(got)
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    g = got.astype(want.dtype)
    pairs = [(g.real, want.real, np.real(tol)), (g.imag, want.imag, np.imag(tol))] \
        if want.dtype.kind == "c" else [(g, want, tol)]
    for part_got, part_want, part_tol in pairs:
        err = np.abs(part_got - part_want)
        bad = ~(err <= part_tol)
        assert not bad.any(), (f"{label}: {int(bad.sum())} of {bad.size} values beyond the "
                               f"derived tolerance; worst error {err[bad].max()!r} > "
                               f"{np.asarray(part_tol)[bad].min()!r}")


def exact_when_order_is_fixed(inputs, dtype, mean=True, degree=None):
    """The bitwise result for at most 2 ranks, where a + b = b + a leaves MPI
    no choice of order: the sum in the wire dtype, the mean as mpigrad applies
    it, one cast back. None for 3 or more ranks."""
    if len(inputs) > 2:
        return None
    wire = wire_dtype(dtype)
    total = np.asarray(inputs[0]).astype(wire)
    if len(inputs) == 2:
        total = total + np.asarray(inputs[1]).astype(wire)
    degree = len(inputs) if degree is None else degree
    if mean and degree != 1:
        total = total * wire.type(1.0 / degree)
    return np.asarray(total).astype(dtype)


# -- communicators ------------------------------------------------------------
def _world_size():
    """The job's rank count, from the launcher's environment (MPI is not started here)."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


#: the communicators a collective test runs on: the world, a split of it, and one of size 1,
#: the last only at up to 2 ranks (at more it repeats the 2-rank run, each rank alone)
COMM_KINDS = ("world", "split", "self") if _world_size() <= 2 else ("world", "split")


def make_comm(kind):
    """(communicator, free it after?) for a test: COMM_WORLD, the even or odd
    world ranks (by parity), or a communicator of size 1."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if kind == "world":
        return world, False
    if kind == "split":
        return world.Split(world.rank % 2, world.rank), True
    return MPI.COMM_SELF, False


def watching(comm, names, before):
    """A communicator like ``comm`` whose collectives ``names``, called on it
    or on a duplicate of it (mpigrad's Reducer duplicates), first call
    ``before(name without the non-blocking "I", the receive array)``."""
    from mpi4py import MPI

    def watched(name):
        short = name.lstrip("I").capitalize() if name.startswith("I") else name

        def call(self, *args, **kwargs):
            buf = args[1] if len(args) > 1 else args[0]
            before(short, buf[0] if isinstance(buf, (list, tuple)) else buf)
            return getattr(MPI.Intracomm, name)(self, *args, **kwargs)
        return call

    return type("Watched", (MPI.Intracomm,), {n: watched(n) for n in names})(comm)


def recording(comm):
    """(a communicator like ``comm``, its log): every collective called on it,
    or on a duplicate of it, is appended to the log as (name without the
    non-blocking "I", the receive array)."""
    log = []
    names = ["Allreduce", "Iallreduce", "Allgather", "Iallgather", "Allgatherv",
             "Iallgatherv", "Bcast", "Ibcast"]
    return watching(comm, names, lambda name, array: log.append((name, array))), log


def _job_processes(launcher, pipe):
    """The processes of a job: ``launcher``'s descendants (proxies and ranks
    keep its parentage whatever session they made for themselves) and those
    still holding its output ``pipe`` open (once the launcher is gone)."""
    name = f"pipe:[{os.fstat(pipe.fileno()).st_ino}]"
    parents, holders = {}, set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parents[int(pid)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            if int(pid) != os.getpid() and any(os.readlink(f"/proc/{pid}/fd/{fd}") == name
                                               for fd in os.listdir(f"/proc/{pid}/fd")):
                holders.add(int(pid))
        except (OSError, IndexError, ValueError):     # gone meanwhile
            continue
    job, todo = set(), [launcher, *holders]
    while todo:
        pid = todo.pop()
        if pid in parents and pid not in job:
            job.add(pid)
            todo += [child for child, parent in parents.items() if parent == pid]
    return sorted(job)


#: the environment of a job whose stacks are shown if it hangs (faulthandler on)
STACKS_ENV = {"PYTHONFAULTHANDLER": "1"}
#: how long the Python processes of a hung job have to write their stacks out
_STACK_SECONDS = 2.0


def _is_python(pid):
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python")
    except OSError:
        return False


def _describe_and_kill(pids):
    """A `ps` listing of ``pids``; then the Python stacks of the Python
    processes among them (SIGABRT: faulthandler, on in the jobs started with
    STACKS_ENV, writes each thread's stack to the process's stderr, the job's
    output; no core file; MPICH's launcher may end the other ranks, or stop
    passing on their output, once the first has aborted), then SIGKILL to each."""
    if not pids:
        return ""
    listing = subprocess.run(["ps", "-o", "pid,ppid,stat,etime,args", "-p",
                              ",".join(map(str, pids))], capture_output=True, text=True).stdout
    pythons = [pid for pid in pids if _is_python(pid)]
    for pid in pythons:
        try:
            resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
            os.kill(pid, signal.SIGABRT)
        except OSError:
            pass
    if pythons:
        time.sleep(_STACK_SECONDS)
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    return listing.strip()


def stop_job(launcher, pipe):
    """Stop the job of the Popen ``launcher`` whose output is ``pipe``: its
    processes listed (``ps``), the stacks of its Python processes written to
    its output (started with STACKS_ENV), every one killed; the listing."""
    return _describe_and_kill(_job_processes(launcher.pid, pipe))


def run_until(cmd, env, limit, finished=None, errors=None, cwd=None):
    """(exit status, stdout and stderr together) of the job ``cmd``, run in
    a session of its own with ``env`` added to this environment less
    MPIGRAD_TIMEOUT (each job sets its own); the test fails if the launcher
    is still running after ``limit`` seconds (the session is killed), unless
    ``finished(output)`` says that what it printed is complete (then the
    status is None), and also if processes of the job outlive the launcher
    (they would hold its output open). A failure lists the job's processes
    still alive (those holding its output open: ranks, proxies, launcher),
    shows the stacks of its Python processes, kills them, and adds
    ``errors()`` (the ranks' own stderr). ``cwd``: where it runs."""
    import pytest
    inherited = {k: v for k, v in os.environ.items() if k != "MPIGRAD_TIMEOUT"}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**inherited, **STACKS_ENV, **(env or {})},
                            start_new_session=True, cwd=cwd)
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()

    def report(what):
        alive = stop_job(proc, proc.stdout)
        reader.join(10)
        return (f"{what}\nprocesses of the job still alive then:\n{alive or '(none)'}\n"
                f"it printed:\n{''.join(chunks)}" + (f"\nranks' stderr:\n{errors()}" if errors else ""))

    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        message = report(f"the job hung: the launcher was still running after {limit} s")
        if finished is not None and finished("".join(chunks)):
            return None, "".join(chunks)
        pytest.fail(message)
    except BaseException as stopped:  # the test's own time ran out first (pytest-timeout's
        # signal method, the serial step's), or Ctrl-C: the job is killed, and reported
        message = report(f"the test was stopped while the job ran: {stopped!r}")
        if isinstance(stopped, KeyboardInterrupt):
            raise
        pytest.fail(message)
    reader.join(10)
    if reader.is_alive():            # the launcher ended, processes of its job did not
        pytest.fail(report("the launcher exited but processes of its job kept running"))
    return proc.returncode, "".join(chunks)


def nodes(comm):
    """How many nodes ``comm`` spans (hosts, cut further by MPIGRAD_NODE_SIZE)."""
    from mpi4py import MPI           # here: the serial tests import this module without MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    size = int(os.environ.get("MPIGRAD_NODE_SIZE") or 0)
    if size:
        part = node.Split(MPI.COMM_WORLD.rank // size, comm.rank)
        node.Free()
        node = part
    first = node.rank == 0
    node.Free()
    return comm.allreduce(int(first))


def _top(dtype):
    """2**(emax + 1): where round to nearest overflows to inf."""
    return {2: 2 ** 16, 4: 2 ** 128, 8: 2 ** 1024}[np.dtype(dtype).itemsize] \
        if np.dtype(dtype) != bfloat16 else 2 ** 128


def exactly_rounded(fraction, dtype):
    """The exact ``fraction`` (a fractions.Fraction) rounded once to nearest
    even in ``dtype`` (float16, bfloat16, float32, float64): a reference for
    exact sums that never rounds twice."""
    from fractions import Fraction
    dtype = np.dtype(dtype)
    if fraction == 0:
        return np.zeros((), dtype)[()]
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    guess = np.array([float(fraction)]).astype(dtype)
    bits = guess.view(uint)[0]
    best = None
    for step in (-1, 0, 1):
        if not 0 <= int(bits) + step <= np.iinfo(uint).max:
            continue
        candidate = np.array([int(bits) + step], uint).view(dtype)
        value = float(candidate[0])
        if math.isnan(value):
            continue
        exact = Fraction(_top(dtype)) * (1 if value > 0 else -1) if math.isinf(value) \
            else Fraction(value)
        key = (abs(exact - fraction), int(candidate.view(uint)[0]) & 1)
        if best is None or key < best[0]:
            best = (key, candidate[0])
    return best[1]


def exact_reference(trees, divisor=1):
    """Per leaf of pytrees of numpy arrays (flat lists, or dicts by key): the
    exact sum over ``trees`` divided by ``divisor``, rounded once to the
    leaf's dtype (complex as real and imaginary parts)."""
    from fractions import Fraction
    keys = sorted(trees[0]) if isinstance(trees[0], dict) else range(len(trees[0]))
    out = {} if isinstance(trees[0], dict) else [None] * len(trees[0])
    for key in keys:
        first = trees[0][key]
        real = np.dtype(f"f{first.dtype.itemsize // 2}") if first.dtype.kind == "c" else first.dtype
        flat = [np.ascontiguousarray(t[key]).reshape(-1).view(real) for t in trees]
        values = np.array([exactly_rounded(sum(Fraction(float(a[i])) for a in flat) / divisor,
                                           real) for i in range(flat[0].size)], real)
        out[key] = values.view(first.dtype).reshape(first.shape)
    return out

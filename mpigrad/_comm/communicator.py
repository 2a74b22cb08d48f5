"""The MPI side: a Reducer's communicator (a watched duplicate, watch.py), the
collectives mpigrad issues and the cross-rank agreement on errors."""

import hashlib
import os
import pickle
import sys
import warnings
from contextlib import contextmanager
from typing import Dict, List

import numpy as np
from mpi4py import MPI

from .._base.errors import DivergenceError, PeerError, StructureMismatchError
from .._base.settings import DEFAULT_CHUNK_BYTES
from .structure import describe_mismatch
from .ulfm import agree
from .watch import Channel

__all__ = ["AGREED_BITS", "Communicator", "DEFAULT_CHUNK_BYTES", "mpi_datatype",
           "install_abort_handler"]

#: how many bits of ``Communicator.agree``'s ``bits`` are agreed on
AGREED_BITS = 16

_MPI_TYPES: Dict[np.dtype, MPI.Datatype] = {}
_I64 = MPI.INT64_T


def mpi_datatype(dtype):
    """The predefined MPI datatype of a numpy dtype (cached)."""
    try:
        return _MPI_TYPES[dtype]
    except KeyError:
        return _MPI_TYPES.setdefault(dtype, MPI.Datatype.fromcode(np.dtype(dtype).char))


def _checksum(array):
    digest = hashlib.blake2b(np.ascontiguousarray(array).view(np.uint8), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


_HELPERS: List[int] = []      # the MPI attribute key caching {parent type: helper Communicator}
_LAUNCH_CHECKED: List[bool] = []

#: what launchers set to the number of tasks they started
_LAUNCHER_SIZES = ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "PMIX_SIZE", "OMPI_COMM_WORLD_SIZE",
                   "MPI_LOCALNRANKS")


def warn_if_split_launch():
    """Warn (once per process) when MPI's world has 1 rank while the launcher
    says it started several tasks: N copies of a 1-rank job, not one job."""
    if _LAUNCH_CHECKED or MPI.COMM_WORLD.Get_size() != 1:
        return
    _LAUNCH_CHECKED.append(True)
    for name in _LAUNCHER_SIZES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            warnings.warn(
                f"mpigrad: MPI's world has 1 rank but {name}={value}: the launcher started "
                f"{value} separate 1-rank jobs that will not talk to each other. Under Slurm "
                "launch with `srun --mpi=pmi2` (or `mpiexec -n $SLURM_NTASKS` inside the "
                "allocation); elsewhere with the MPI library's own mpiexec.",
                RuntimeWarning, stacklevel=3)
            return


def _free_helpers(parent, keyval, helpers):
    for helper in helpers.values():
        helper.free()


class Communicator:
    """A Reducer's side of the MPI communication: collectives on its own
    duplicate of the caller's communicator, watched (see watch.py).

    Args:
        comm: an mpi4py intracommunicator; default ``MPI.COMM_WORLD``.
        chunk_bytes: the largest message of one Allreduce call.
        timeout: seconds a collective may take before the job is aborted with
            a diagnostic; None waits forever (a peer that leaves still raises).
    """

    def __init__(self, comm=None, chunk_bytes=DEFAULT_CHUNK_BYTES, timeout=None):
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm: expecting an mpi4py Intracomm, got {type(comm).__name__}")
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        warn_if_split_launch()
        self.channel = Channel(comm, timeout)
        self.comm = self.channel.comm
        self.calls = 0
        self.freed = False

    def rejoin(self, comm):
        """Carry on over ``comm`` (the survivors of a shrink, new and private
        to this Communicator), watched, in place of the revoked duplicate
        (collective over ``comm``)."""
        self.channel.abandon()
        # MPI's fault-tolerant agreement: every survivor returns, or all of
        # them raise if another rank was lost meanwhile; the communicator is
        # new, so any token the survivors share will do
        token = agree(comm, self.timeout) | (1 << 40)
        self.channel = Channel(comm, self.timeout, duplicate=False, token=token)
        self.comm = self.channel.comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.calls = 0

    @classmethod
    def helper(cls, comm=None, timeout=None):
        """The Communicator that mpigrad's functions (broadcast, ...) share on
        ``comm``: made on the first call (collectively), kept with the duplicate."""
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm: expecting an mpi4py Intracomm, got {type(comm).__name__}")
        if not _HELPERS:
            _HELPERS.append(MPI.Comm.Create_keyval(delete_fn=_free_helpers))
        helpers = comm.Get_attr(_HELPERS[0])        # cached on the parent, freed with it
        if helpers is None:
            helpers = {}
            comm.Set_attr(_HELPERS[0], helpers)
        helper = helpers.get(type(comm))
        if helper is None:
            helper = helpers[type(comm)] = cls(comm, DEFAULT_CHUNK_BYTES, timeout)
        helper.timeout = timeout
        return helper

    @contextmanager
    def call(self, begin=True, completes=True):
        """One call of a Reducer or function: one thread at a time, numbered
        (``begin``), ended when the block ends (``completes``; by an
        exception, always). Raises RuntimeError once freed, a call begun
        before ``free()`` included."""
        if self.freed:
            raise RuntimeError("this Reducer was freed; create a new one")
        with self.channel.entered():
            if begin:
                self.begin_call()
            try:
                yield
            except BaseException:
                self.end_call(failed=True)
                raise
            if completes:
                self.end_call()

    def begin_call(self):
        """Start a new call (numbered for stall diagnostics)."""
        self.calls += 1

    def end_call(self, failed=False):
        """The current call ended (``failed``: by an exception). A goodbye
        says how far this rank got, so that peers still in a call know
        whether its collectives can complete (see Channel.goodbye)."""
        self.channel.settled = self.calls
        if not failed:
            self.channel.finished = self.calls

    def wait(self, request, what):
        """Complete ``request`` under the watch (PeerError if a peer leaves,
        abort with a diagnostic past the timeout)."""
        self.channel.wait(request, what, self.calls, self.timeout)

    def collective(self, name, args, what, comm=None):
        """Run collective ``name`` (e.g. "Allreduce") as its non-blocking twin
        under the watch: as fast as the blocking call, and it cannot hang.
        ``comm``: a communicator split from the duplicate (default: the
        duplicate itself)."""
        self.channel.check(self.calls, self.timeout)    # a peer that left will not take part
        comm = self.comm if comm is None else comm
        self.wait(getattr(comm, "I" + name.lower())(*args), what)

    def _allreduce(self, buf, op, what):
        self.collective("Allreduce", (MPI.IN_PLACE, buf, op), what)

    def allreduce(self, buf, op, what="Allreduce"):
        """Reduce the contiguous array ``buf`` with MPI op ``op``, in place (watched)."""
        if buf.size:
            self._allreduce([buf, mpi_datatype(buf.dtype)], op, what)

    # -- collectives -----------------------------------------------------
    def allreduce_sum(self, buf, what="Allreduce"):
        """Sum the 1-D contiguous array ``buf`` over all ranks, in place, in
        pieces of at most ``chunk_bytes``.

        ``what`` names the collective for the watchdog (a string, or a
        callable that returns one, evaluated only on a stall).
        """
        for piece in self.pieces(buf):
            self._allreduce(piece, MPI.SUM, what)

    def pieces(self, buf):
        """``buf`` cut into the messages ``allreduce_sum`` would send."""
        if buf.size == 0:
            return []
        datatype = mpi_datatype(buf.dtype)
        step = max(1, self.chunk_bytes // buf.itemsize)
        return [[buf[start:start + step], datatype] for start in range(0, buf.size, step)]

    def start_sum(self, piece):
        """Start summing one piece (from ``pieces``) in place; returns its request."""
        self.channel.check(self.calls, self.timeout)
        return self.comm.Iallreduce(MPI.IN_PLACE, piece, MPI.SUM)

    def start_reduce_scatter_sum(self, send, recv, counts):
        """Start summing the 1-D ``send`` over all ranks; this rank receives
        its ``counts[rank]`` elements of the sum in ``recv`` (rank order: rank
        r gets the r-th range of ``counts``); returns the request (``wait``)."""
        self.channel.check(self.calls, self.timeout)
        datatype = mpi_datatype(send.dtype)
        return self.comm.Ireduce_scatter([send, datatype], [recv, datatype],
                                         [int(c) for c in counts], MPI.SUM)

    def allgather_counts(self, local, what="Allgather of sparse row counts"):
        """Every rank's int64 vector ``local``, as a (ranks, len(local)) matrix."""
        local = np.ascontiguousarray(local, dtype=np.int64)
        out = np.empty((self.size, local.size), np.int64)
        self.collective("Allgather", ([local, _I64], [out, _I64]),
                         what)
        return out

    def allgatherv(self, send, counts, what="Allgatherv", out=None):
        """Concatenate every rank's 1-D ``send`` in rank order (into ``out``,
        1-D of their total size, else a new array); ``counts[r]`` is rank r's
        element count."""
        counts = [int(c) for c in counts]
        displs = np.cumsum([0] + counts[:-1]).tolist()
        recv = np.empty(sum(counts), send.dtype) if out is None else out
        if recv.size:
            datatype = mpi_datatype(send.dtype)
            self.collective("Allgatherv", ([send, datatype], [recv, (counts, displs), datatype]),
                             what)
        return recv

    # -- agreement -------------------------------------------------------
    def agree(self, error, fingerprint, describe, extra=0, bits=0, absent=False):
        """Raise on every rank unless all ranks passed and their fingerprints
        match; return (the largest ``extra``, an int >= 0, of any rank; the
        OR over all ranks of ``bits``, an int of AGREED_BITS bits).

        One Allreduce(MAX) of (failed, h, -h, extra, each bit) carries it all:
        a rank whose local checks raised ``error`` re-raises it, the others
        raise PeerError; on a fingerprint mismatch ``describe()`` is gathered
        to say what differs. An ``absent`` rank takes part without a
        fingerprint of its own (Horovod's joined ranks): the others' must match.
        """
        h = np.iinfo(np.int64).min if absent else fingerprint
        flags = np.array([error is not None, h, h if absent else -fingerprint, extra,
                          *((bits >> k) & 1 for k in range(AGREED_BITS))], np.int64)
        self._allreduce([flags, _I64], MPI.MAX, "structure check")
        if flags[0]:
            report = None if error is None else f"{type(error).__name__}: {error}"
            reports = self.allgather_objects(report)
            if error is not None:
                raise error
            failed = [r for r, m in enumerate(reports) if m is not None]
            raise PeerError(failed, [reports[r] for r in failed])
        everyone_absent = int(flags[1]) == int(flags[2]) == np.iinfo(np.int64).min
        if not everyone_absent and int(flags[1]) != -int(flags[2]):
            raise StructureMismatchError(describe_mismatch(self.allgather_objects(describe())))
        return int(flags[3]), sum(int(flag) << k for k, flag in enumerate(flags[4:]))

    def start_check(self, fingerprint):
        """Begin comparing ``fingerprint`` across ranks beside a call's messages
        (``check=False``: no agreement before them); ``complete()`` of the
        returned object raises StructureMismatchError on every rank where the
        fingerprints differ."""
        self.channel.check(self.calls, self.timeout)
        flags = np.array([fingerprint, -fingerprint], np.int64)
        return _CheckBeside(self, self.comm.Iallreduce(MPI.IN_PLACE, [flags, _I64], MPI.MAX),
                            flags)

    def allgather_objects(self, obj, what="error reports"):
        """Every rank's picklable ``obj``, in rank order (watched)."""
        mine = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = self.allgather_counts([mine.size], f"Allgather of the sizes of {what}")[:, 0]
        data = self.allgatherv(mine, sizes, f"Allgatherv of {what}")
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        return [pickle.loads(data[a:b].tobytes()) for a, b in zip(bounds[:-1], bounds[1:])]

    def bcast_bytes(self, buf, root, what):
        """Broadcast the uint8 array ``buf`` from ``root``, in place, in pieces
        of at most 1 GiB (MPI counts are ints)."""
        step = 1 << 30
        for start in range(0, buf.size, step):
            self.collective("Bcast", ([buf[start:start + step], MPI.BYTE], root), what)

    def verify_same(self, arrays, what):
        """Raise DivergenceError on every rank unless ``arrays`` are bitwise equal
        on all ranks (one Allreduce of checksums)."""
        sums = np.array([_checksum(a) for a in arrays], np.int64)
        flags = np.concatenate([sums, -sums])
        self._allreduce([flags, _I64], MPI.MAX, f"verify of {what}")
        bad = np.nonzero(flags[:sums.size] != -flags[sums.size:])[0]
        if bad.size:
            raise DivergenceError(f"{what}: results differ across ranks at "
                                  f"{[int(b) for b in bad]}; the MPI library's reduction "
                                  "is not deterministic across ranks")

    def free(self):
        """Free the duplicate; the peers are told (idempotent: a second call
        touches nothing, not even a module global gone at interpreter exit)."""
        if self.freed:
            return
        self.channel.free()
        self.freed = True
        self.comm = MPI.COMM_NULL

    def break_with(self, error):
        """Raise ``error`` (a PeerError) at every later collective: a collective
        of this communicator had to be abandoned."""
        self.channel.broken = error


def install_abort_handler() -> None:
    """Make an uncaught exception on this rank abort the whole MPI job.

    For programs that cannot be launched as ``python -m mpi4py script.py``:
    without it, the other ranks would wait forever in their next collective.
    """
    previous = sys.excepthook

    def abort_on_uncaught(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_on_uncaught


class _CheckBeside:
    """A structure check in flight beside a call's messages (start_check)."""

    def __init__(self, communicator, request, flags):
        self.communicator = communicator
        self.request = request
        self.flags = flags

    def complete(self):
        """Raise StructureMismatchError on every rank if the fingerprints differ."""
        self.communicator.wait(self.request, "structure check beside the data (check=False)")
        if self.flags[0] != -self.flags[1]:
            raise StructureMismatchError(
                "check=False: the ranks made different calls (gradient structure, call kind "
                "or agreed values differ), so the messages they summed do not match and the "
                "results are meaningless (in place: the gradients hold them); run with "
                "check=True to have the difference named before any data moves")

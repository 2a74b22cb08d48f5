"""Bucket memory that the ranks of a node share, and the reduction on it.

Each rank's buckets live in a memory segment that every rank of its node maps:
a file in /dev/shm, created and sized (posix_fallocate: a full /dev/shm is an
error here, not a SIGBUS later) by its rank, mapped by the others, and unlinked
as soon as all have mapped it, so nothing outlives the processes. A process
killed in that window leaves its file behind: files are named after their
process (``mpigrad-<pid>-...``), and those of dead processes are removed by
the next node memory made on the machine (``remove_orphans``). A mapping
keeps no file descriptor (Python's mmap would keep one per mapping: a node of
L ranks would hold L per plan), and is unmapped when its last array goes.
Failing to create or map a segment (no space, no descriptors) is agreed by
every rank: with shared_memory="auto" the plan then goes through MPI.
MPI-3 shared windows would do the same, but MPI_Win_free is collective: a
Reducer freed (or collected) at different moments on different ranks would
deadlock there; unmapping is local.

The reduction of a bucket arena of n elements over a node of L ranks: each
local rank sums its own 1/L slice of all L segments, in cache-sized pieces, in
local rank order (the same additions whichever rank does them, so results are
bitwise equal everywhere and do not depend on timing), and writes each summed
piece, with the mean, into every local rank's segment while it is in cache (no
other rank touches that slice of any segment meanwhile): each rank reads and
writes n elements, as a copy of its arena would. Across nodes the slice is
first summed among the ranks that own it (an Allreduce on the cross-node
communicator), then scaled and pushed. Two node barriers per call: before the
sum (every rank's buckets written) and after it (every slice pushed).
"""

import ctypes
import mmap
import os
import re
import secrets
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .._base.ranges import shard_range
from .._base.libc import LIBC
from . import Settler
from .node_groups import NodeGroups
from .node_sum import sum_slice

__all__ = ["SharedBuckets", "shared_memory_problem", "remove_orphans", "SEGMENT_DIR",
]


SEGMENT_DIR = "/dev/shm"
_ALIGN = 64                          # bytes: each arena starts on a cache line
_PIECE_BYTES = 256 << 10             # the node sum's working set per piece
_NAME_BYTES = 96
_PREFIX = "mpigrad-"
_OWNED_BY = re.compile(_PREFIX + r"(\d+)-[0-9a-f]+$")

LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def shared_memory_problem() -> Optional[str]:
    """Why this rank cannot make node-shared segments (None if it can)."""
    if not os.path.isdir(SEGMENT_DIR) or not os.access(SEGMENT_DIR, os.W_OK):
        return f"{SEGMENT_DIR} is not a writable directory"
    return None


def _layout(sizes: Dict[np.dtype, int]) -> Tuple[Dict[np.dtype, Tuple[int, int]], int]:
    """{dtype: (byte offset, elements)} for arenas of ``sizes`` side by side,
    in a fixed (name) order; and the bytes they take."""
    offsets: Dict[np.dtype, Tuple[int, int]] = {}
    end = 0
    for dtype in sorted(sizes, key=lambda d: d.str + d.name):
        offsets[dtype] = (end, sizes[dtype])
        end += -(-sizes[dtype] * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, max(end, _ALIGN)


def remove_orphans() -> int:
    """Remove the segments of processes of this machine that no longer run
    (killed between creating a segment and its unlinking); return how many."""
    removed = 0
    try:
        names = os.listdir(SEGMENT_DIR)
    except OSError:
        return 0
    for name in names:
        owner = _OWNED_BY.match(name)
        if owner is None or _alive(int(owner.group(1))):
            continue
        try:
            os.unlink(os.path.join(SEGMENT_DIR, name))
            removed += 1
        except OSError:            # another's, or removed meanwhile
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:        # another user's process
        return True
    return True


def _map_fd(fd: int, nbytes: int) -> Any:
    """A writable buffer of ``nbytes`` mapping ``fd`` shared; it keeps no
    descriptor and is unmapped when the buffer (every array on it) is gone."""
    address = LIBC.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    buffer = (ctypes.c_ubyte * nbytes).from_address(address)
    weakref.finalize(buffer, LIBC.munmap, address, nbytes)
    return buffer


def _create(nbytes: int) -> Tuple[Optional[str], Any]:
    """(path, mapping) of a new segment of ``nbytes``, or (None, reason)."""
    path = os.path.join(SEGMENT_DIR, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return None, f"cannot create {path}: {exc}"
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return path, _map_fd(fd, nbytes)
    except OSError as exc:
        os.unlink(path)
        return None, f"cannot reserve and map {nbytes} bytes in {SEGMENT_DIR}: {exc}"
    finally:
        os.close(fd)


def _map(path: str, nbytes: int) -> Tuple[Any, Optional[str]]:
    """(the mapping of the peer's segment ``path``, None) or (None, reason)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        return None, f"cannot open {path}: {exc}"
    try:
        return _map_fd(fd, nbytes), None
    except OSError as exc:
        return None, f"cannot map {path}: {exc}"
    finally:
        os.close(fd)


class SharedBuckets:
    """The node's segments for one plan, and the node reduction on them.

    Collective over the node (every local rank, the same plan). ``arenas``
    maps each wire dtype to this rank's arena in its own segment (the bucket
    buffers are views of it); ``failure`` is a reason when some rank of the
    node could not make its segment (then nothing is mapped).
    """

    def __init__(self, groups: NodeGroups, sizes: Dict[np.dtype, int]) -> None:
        self.groups = groups
        offsets, nbytes = _layout(sizes)
        path, own = _create(nbytes)
        reply = ("!" + own if path is None else path).encode()[:_NAME_BYTES]
        names = groups.allgather_bytes(reply, _NAME_BYTES, "exchange of shared segment names")
        # every node must have its segments, or no rank uses them
        self.failure: Optional[str] = None
        if not groups.agree_all(all(not n.startswith(b"!") for n in names),
                                "shared segments made"):
            self.failure = groups.reasons(own if path is None else None)
            if path is not None:
                os.unlink(path)
            return
        assert path is not None           # every rank made its segment
        mapped = [(own, None) if r == groups.local_rank else _map(n.decode(), nbytes)
                  for r, n in enumerate(names)]
        problem = next((reason for _, reason in mapped if reason is not None), None)
        # one agreement, which also tells every rank that the others mapped
        # its segment (or gave up): it can go from the directory
        mapped_everywhere = groups.agree_all(problem is None, "shared segments mapped")
        os.unlink(path)
        if not mapped_everywhere:
            self.failure = groups.reasons(problem)
            return
        segments = [segment for segment, _ in mapped]
        self.mapped_bytes = nbytes * len(segments)
        self.peers = [{dtype: np.frombuffer(segment, dtype, size, offset)
                       for dtype, (offset, size) in offsets.items()} for segment in segments]
        self.arenas = self.peers[groups.local_rank]

    def allocate(self, sizes: Dict[np.dtype, int]) -> Dict[np.dtype, np.ndarray]:
        """The bucket memory: {dtype: this rank's arena} (BucketBuffers' ``memory``)."""
        return {dtype: self.arenas[dtype][:size] for dtype, size in sizes.items()}

    def _slice(self, n: int) -> Tuple[int, int]:
        """This rank's [start, stop) of an arena of ``n`` elements: the part it sums."""
        return shard_range(n, self.groups.local_rank, self.groups.local_size)

    #: a sum backend that sums every arena at once, in ``complete``
    incremental = False
    name = "node memory"
    reads_apart = False
    sums_half = False
    in_node_memory = True

    def start(self, overlapped: bool, wire: Optional[str]) -> "_NodeSum":
        """A call's sum (the SumBackend protocol): the runs need not be
        submitted one by one, every arena is summed in ``complete``."""
        return _NodeSum(self, wire)

    def reduce(self, settle: Settler, wire: Optional[str]) -> None:
        """Sum every arena over the node and across nodes, into every local
        rank's segment, settled (the mean, the finite check) by ``settle``
        (an engine Settle) piece by piece while in cache (across nodes through
        ``wire``); the finite flag is then agreed over all ranks (each rank
        checked its own slices)."""
        groups = self.groups
        groups.barrier("node barrier before the shared sum (every rank's buckets written)")
        for dtype, own in self.arenas.items():
            start, stop = self._slice(own.size)
            if groups.nodes == 1 and groups.local_size > 1:      # all on the way
                self._sum_slice(dtype, start, stop, settle, push=True)
            else:
                mine = own[start:stop]
                self._sum_slice(dtype, start, stop, None, push=False)
                groups.allreduce_across(mine, f"Allreduce across nodes of a {dtype.name} slice",
                                        wire)
                settle.piece(dtype, start, mine)
                self._push(dtype, start, stop, mine)
        groups.barrier("node barrier after the shared sum (every slice summed and pushed)")
        # no barrier is needed after: every rank reads only its own segment,
        # and the next call writes into other segments after its first barrier
        settle.agree(lambda finite: groups.agree_all(finite, "finite flag of the shared sum"))

    def _push(self, dtype: np.dtype, lo: int, hi: int, values: np.ndarray) -> None:
        """Write the summed [lo, hi) of the ``dtype`` arena into the other
        local ranks' segments (only this rank reads or writes that part of
        them in the sum phase)."""
        for local, peer in enumerate(self.peers):
            if local != self.groups.local_rank:
                peer[dtype][lo:hi] = values

    def _sum_slice(self, dtype: np.dtype, start: int, stop: int, settle: Optional[Settler],
                   push: bool) -> None:
        """Sum [start, stop) of every local rank's ``dtype`` arena into this
        rank's, piece by piece, settled by ``settle`` (None: not) and, with
        ``push``, written into the others' segments while in cache."""
        step = max(1, _PIECE_BYTES // dtype.itemsize)
        pieces = min(step, max(stop - start, 1))

        def finish(lo: int, piece: np.ndarray) -> None:
            if settle is not None:
                settle.piece(dtype, lo, piece)
            if push:
                self._push(dtype, lo, lo + piece.size, piece)

        sum_slice(self.arenas[dtype], start, stop, self.groups.local_rank, len(self.peers),
                  lambda rank, lo, hi, into: self.peers[rank][dtype][lo:hi],
                  np.empty(pieces, dtype), np.empty(pieces, dtype), finish)


class _NodeSum:
    """One call's sum in node memory (a Summation: see mpigrad._backends)."""

    def __init__(self, shared: SharedBuckets, wire: Optional[str]) -> None:
        self.shared, self.wire = shared, wire

    def submit(self, first: int, last: int, members: Sequence[np.ndarray],
               sources: Sequence[Optional[np.ndarray]]) -> None:
        """Nothing to do: the members already lie in this rank's segment."""

    def progress(self) -> None:
        """Nothing to do: the node sum runs in ``complete``."""

    def complete(self, settle: Settler) -> None:
        """Sum every arena over the node (and across nodes), settled."""
        self.shared.reduce(settle, self.wire)

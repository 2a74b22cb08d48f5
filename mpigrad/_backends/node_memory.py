"""Bucket memory that the ranks of a node share, and the reduction on it.

Each rank's buckets live in a memory segment that every rank of its node maps:
a file in /dev/shm, created and sized (posix_fallocate: a full /dev/shm is an
error here, not a SIGBUS later) by its rank, mapped by the others, and unlinked
as soon as all have mapped it, so nothing outlives the processes. MPI-3 shared
windows would do the same, but MPI_Win_free is collective: a Reducer freed (or
collected) at different moments on different ranks would deadlock there;
unmapping is local.

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

import mmap
import os
import secrets

import numpy as np

__all__ = ["SharedBuckets", "shared_memory_problem", "SEGMENT_DIR", "NOT_SHARED"]

#: a plan's ``shared`` when its node memory could not be made ("auto": it
#: goes through MPI's Allreduce and is not tried again); None: not tried yet
NOT_SHARED = False

SEGMENT_DIR = "/dev/shm"
_ALIGN = 64                          # bytes: each arena starts on a cache line
_PIECE_BYTES = 256 << 10             # the node sum's working set per piece
_NAME_BYTES = 96


def shared_memory_problem():
    """Why this rank cannot make node-shared segments (None if it can)."""
    if not os.path.isdir(SEGMENT_DIR) or not os.access(SEGMENT_DIR, os.W_OK):
        return f"{SEGMENT_DIR} is not a writable directory"
    return None


def _layout(sizes):
    """{dtype: (byte offset, elements)} for arenas of ``sizes`` side by side,
    in a fixed (name) order; and the bytes they take."""
    offsets, end = {}, 0
    for dtype in sorted(sizes, key=lambda d: d.str + d.name):
        offsets[dtype] = (end, sizes[dtype])
        end += -(-sizes[dtype] * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, max(end, _ALIGN)


def _create(nbytes):
    """(path, mmap) of a new segment of ``nbytes``, or (None, reason)."""
    path = os.path.join(SEGMENT_DIR, f"mpigrad-{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return None, f"cannot create {path}: {exc}"
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return path, mmap.mmap(fd, nbytes)
    except OSError as exc:
        os.unlink(path)
        return None, f"cannot reserve {nbytes} bytes in {SEGMENT_DIR}: {exc}"
    finally:
        os.close(fd)


def _map(path, nbytes):
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


class SharedBuckets:
    """The node's segments for one plan, and the node reduction on them.

    Collective over the node (every local rank, the same plan). ``arenas``
    maps each wire dtype to this rank's arena in its own segment (the bucket
    buffers are views of it); ``failure`` is a reason when some rank of the
    node could not make its segment (then nothing is mapped).
    """

    def __init__(self, groups, sizes):
        self.groups = groups
        offsets, nbytes = _layout(sizes)
        path, own = _create(nbytes)
        reply = ("!" + own if path is None else path).encode()[:_NAME_BYTES]
        names = groups.allgather_bytes(reply, _NAME_BYTES, "exchange of shared segment names")
        # every node must have its segments, or no rank uses them
        self.failure = None
        if not groups.agree_all(all(not n.startswith(b"!") for n in names),
                                "shared segments made"):
            self.failure = groups.reasons(own if path is None else None)
            if path is not None:
                os.unlink(path)
            return
        segments = [own if r == groups.local_rank else _map(n.decode(), nbytes)
                    for r, n in enumerate(names)]
        groups.barrier("mapping of the shared segments")
        os.unlink(path)                       # every rank has mapped it
        self.peers = [{dtype: np.frombuffer(segment, dtype, size, offset)
                       for dtype, (offset, size) in offsets.items()} for segment in segments]
        self.arenas = self.peers[groups.local_rank]

    def allocate(self, sizes):
        """The bucket memory: {dtype: this rank's arena} (BucketBuffers' ``memory``)."""
        return {dtype: self.arenas[dtype][:size] for dtype, size in sizes.items()}

    def _slice(self, n):
        """This rank's [start, stop) of an arena of ``n`` elements: the part it sums."""
        local, size = self.groups.local_rank, self.groups.local_size
        return n * local // size, n * (local + 1) // size

    #: a sum backend that sums every arena at once, in ``complete``
    incremental = False

    def start(self):
        """A call's sum (the SumBackend protocol): the runs need not be
        submitted one by one, every arena is summed in ``complete``."""
        return _NodeSum(self)

    def reduce(self, settle):
        """Sum every arena over the node and across nodes, into every local
        rank's segment, settled (the mean, the finite check) by ``settle``
        (an engine Settle) piece by piece while in cache; the finite flag is
        then agreed over all ranks (each rank checked its own slices)."""
        groups = self.groups
        groups.barrier("node barrier before the shared sum (every rank's buckets written)")
        for dtype, own in self.arenas.items():
            start, stop = self._slice(own.size)
            if groups.nodes == 1 and groups.local_size > 1:      # all on the way
                self._sum_slice(dtype, start, stop, settle, push=True)
            else:
                mine = own[start:stop]
                self._sum_slice(dtype, start, stop, None, push=False)
                groups.allreduce_across(mine, f"Allreduce across nodes of a {dtype.name} slice")
                settle.piece(dtype, start, mine)
                self._push(dtype, start, stop, mine)
        groups.barrier("node barrier after the shared sum (every slice summed and pushed)")
        # no barrier is needed after: every rank reads only its own segment,
        # and the next call writes into other segments after its first barrier
        settle.agree(lambda finite: groups.agree_all(finite, "finite flag of the shared sum"))

    def _push(self, dtype, lo, hi, values):
        """Write the summed [lo, hi) of the ``dtype`` arena into the other
        local ranks' segments (only this rank reads or writes that part of
        them in the sum phase)."""
        for local, peer in enumerate(self.peers):
            if local != self.groups.local_rank:
                peer[dtype][lo:hi] = values

    def _sum_slice(self, dtype, start, stop, settle, push):
        """Sum [start, stop) of every local rank's ``dtype`` arena into this
        rank's, piece by piece, settled by ``settle`` (None: not) and, with
        ``push``, written into the others' segments while in cache."""
        sources = [peer[dtype] for peer in self.peers]
        if len(sources) == 1:
            return
        own = self.arenas[dtype]
        step = max(1, _PIECE_BYTES // dtype.itemsize)
        # local ranks 0 and 1 hold an addend of the first addition: their
        # partial sums can grow in place; the others' own values are still
        # to be added when the first addition is done, so theirs go through
        # a scratch piece
        direct = self.groups.local_rank < 2
        scratch = None if direct else np.empty(min(step, max(stop - start, 1)), dtype)
        for lo in range(start, stop, step):
            hi = min(lo + step, stop)
            acc = own[lo:hi] if direct else scratch[:hi - lo]
            np.add(sources[0][lo:hi], sources[1][lo:hi], out=acc)
            for source in sources[2:]:
                np.add(acc, source[lo:hi], out=acc)
            if settle is not None:
                settle.piece(dtype, lo, acc)
            if not direct:
                own[lo:hi] = acc
            if push:
                self._push(dtype, lo, hi, acc)


class _NodeSum:
    """One call's sum in node memory (a Summation: see mpigrad._backends)."""

    def __init__(self, shared):
        self.shared = shared

    def submit(self, first, last, members):
        """Nothing to do: the members already lie in this rank's segment."""

    def progress(self):
        """Nothing to do: the node sum runs in ``complete``."""

    def complete(self, settle):
        """Sum every arena over the node (and across nodes), settled."""
        self.shared.reduce(settle)

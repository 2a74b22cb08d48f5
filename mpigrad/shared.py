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
bitwise equal everywhere and do not depend on timing); across nodes each slice
is then summed among the ranks that own it (an Allreduce on the cross-node
communicator); after the mean (and the finite check) on that slice, every rank
reads the slices it does not own straight from their owners' segments as it
writes its results (a Readout): each summed value is copied once, to where
the caller reads it. Bucket views, which live in the rank's own segment, get
the other slices copied in (``collect``). Three node barriers keep the phases
apart.
"""

import mmap
import os
import secrets

import numpy as np

from .settle import settle

__all__ = ["SharedBuckets", "Readout", "shared_memory_problem", "SEGMENT_DIR", "NOT_SHARED"]

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

    def _slice(self, n, local=None):
        """Local rank ``local``'s (default this rank's) [start, stop) of an
        arena of ``n`` elements: the part it sums."""
        local = self.groups.local_rank if local is None else local
        size = self.groups.local_size
        return n * local // size, n * (local + 1) // size

    def _parts(self, dtype, start, stop):
        """(local rank, lo, hi): the parts of [start, stop) of the ``dtype``
        arena, by the local rank that sums them, in order."""
        n = self.arenas[dtype].size
        for local in range(self.groups.local_size):
            first, last = self._slice(n, local)
            lo, hi = max(start, first), min(stop, last)
            if lo < hi:
                yield local, lo, hi

    def sources(self, dtype, start, stop):
        """Where the summed [start, stop) of the ``dtype`` arena is after
        ``reduce``: [(lo, hi, memory)] in order, each part in the segment of
        the local rank that summed it."""
        return [(lo, hi, self.peers[local][dtype][lo:hi])
                for local, lo, hi in self._parts(dtype, start, stop)]

    def collect(self, dtype, start, stop):
        """Copy the parts of [start, stop) of the ``dtype`` arena that other
        local ranks summed into this rank's own segment (after ``reduce``,
        before ``done``; no other rank reads those parts of it)."""
        own = self.arenas[dtype]
        for local, lo, hi in self._parts(dtype, start, stop):
            if local != self.groups.local_rank:
                own[lo:hi] = self.peers[local][dtype][lo:hi]

    def readout(self, buffers):
        """The Readout of the BucketBuffers ``buffers`` that live here."""
        return Readout(self, buffers)

    def reduce(self, factor_of, limits):
        """Sum every arena over the node and across nodes: each local rank
        its slice, in its own segment (read them with ``sources``, ``collect``
        or a Readout, then call ``done``); ``factor_of(dtype)`` is the mean's
        factor (None: a sum); ``limits``: {dtype: [(start, stop, limit)]} for
        the finite check, or None. Returns this rank's finite flag (None
        unchecked)."""
        groups = self.groups
        groups.barrier("node barrier before the shared sum (every rank's buckets written)")
        finite = None if limits is None else True
        for dtype, own in self.arenas.items():
            start, stop = self._slice(own.size)
            mine, factor = own[start:stop], factor_of(dtype)
            if groups.nodes == 1 and groups.local_size > 1:
                self._sum_slice(dtype, start, stop, factor)      # the mean on the way
            else:
                self._sum_slice(dtype, start, stop, None)
                groups.allreduce_across(mine, f"Allreduce across nodes of a {dtype.name} slice")
                settle(mine, factor, None)
            if limits is not None:
                for first, last, limit in limits[dtype]:
                    lo, hi = max(first, start), min(last, stop)
                    if lo < hi:
                        finite = settle(own[lo:hi], None, limit) and finite
        groups.barrier("node barrier before the shared copy (every slice summed)")
        return finite

    def _sum_slice(self, dtype, start, stop, factor):
        """Sum [start, stop) of every local rank's ``dtype`` arena into this
        rank's, piece by piece, scaled by ``factor`` (None: not) while in cache."""
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
            settle(acc, factor, None)
            if not direct:
                own[lo:hi] = acc

    def done(self, finite):
        """End a call once every rank of the node has copied what it needs from
        the others' segments (each may write its own again); with a finite
        flag, return it agreed over all ranks (the minimum: the same Allreduce
        is the barrier)."""
        if finite is None:
            self.groups.barrier("node barrier after the shared copy")
            return None
        return self.groups.agree_all(finite, "finite flag of the shared sum")


class Readout:
    """Where each bucket of a plan in node memory is read once summed, with no
    copy into this rank's segment first. ``pieces[i]``: bucket ``i`` as
    (start, stop, memory) in bucket order, each in the segment of the local
    rank that summed it; ``views[i]``: each of its gradients' (position,
    view) there; a gradient that straddles two ranks' slices is read from
    this rank's own segment, once ``collect`` has copied ``straddling[i]``
    (arena ranges) there."""

    def __init__(self, shared, buffers):
        self.pieces, self.views, self.straddling = [], [], []
        for bucket, array, start, slots in zip(buffers.plan.buckets, buffers.arrays,
                                               buffers.starts, buffers.slots):
            found = shared.sources(bucket.dtype, start, start + bucket.size)
            self.pieces.append([(lo - start, hi - start, memory) for lo, hi, memory in found])
            views, straddling = [], []
            for index, lo, hi, shape in slots:
                source = next((memory[lo - first:hi - first] for first, last, memory
                               in self.pieces[-1] if first <= lo and hi <= last), None)
                if source is None:
                    straddling.append((start + lo, start + hi))
                    source = array[lo:hi]
                views.append((index, source.reshape(shape)))
            self.views.append(views)
            self.straddling.append(straddling)

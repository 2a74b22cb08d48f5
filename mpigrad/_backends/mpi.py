"""The MPI sum backend: each message run is summed by MPI's Allreduce in place,
in pieces of at most ``chunk_bytes``.

Pieces are queued and sent one non-blocking Allreduce at a time, the next
started whenever the previous one is found done (on submit, on progress, in
complete): MPICH runs many outstanding Iallreduce calls much slower than the
same calls one after another (docs/performance.md, "Why the defaults"). A
blocking call submits every run and completes at once; an overlapped one
submits each run as backward finishes its gradients.
"""

from collections import deque

import numpy as np

__all__ = ["MpiBackend", "joined"]


class MpiBackend:
    """Sums runs of buckets through the Communicator ``comm`` (watched)."""

    incremental = True
    name = "mpi"
    reads_apart = False

    def __init__(self, comm):
        self.comm = comm

    def start(self):
        """Begin one call's sum."""
        return _MpiSum(self.comm)


def _naming(first, last, members):
    """What a run's message is called in a stall diagnostic (evaluated only then)."""
    def what():
        buckets = f"buckets {first}-{last}" if last > first else f"bucket {first}"
        return (f"Allreduce of {buckets} ({sum(m.nbytes for m in members)} bytes, "
                f"{members[0].dtype.name})")
    return what


class _MpiSum:
    """One call's runs: their pieces queued, one Iallreduce in flight."""

    def __init__(self, comm):
        self.comm = comm
        self.queue = deque()          # (piece, what) not yet started
        self.active = None            # the Started piece in flight
        self.runs = []                # (first, members, run memory if a copy)

    def submit(self, first, last, members, sources):
        run = joined(members)
        copied = run is None
        if copied:                    # this rank's memory of the run is not back to back
            run = np.concatenate(members)
        self.runs.append((first, members, run if copied else None))
        what = _naming(first, last, members)
        self.queue.extend((piece, what) for piece in self.comm.pieces(run))
        self.progress()

    def progress(self):
        self._pump(block=False)

    def _pump(self, block):
        """Start queued pieces one at a time; with ``block``, until all are done."""
        while True:
            if self.active is not None:
                if block:
                    self.comm.wait(self.active)
                elif not self.active.request.Test():
                    return
                self.active = None
            if not self.queue:
                return
            self.active = self.comm.start_sum(*self.queue.popleft())

    def complete(self, settle):
        self._pump(block=True)
        for first, members, copy in self.runs:
            offset = 0
            for i, flat in enumerate(members, first):
                if copy is not None:
                    flat[...] = copy[offset:offset + flat.size]
                    offset += flat.size
                settle.bucket(i, flat)


def _extent(flat):
    """(owner, start): ``flat`` as the slice ``owner[start:start + flat.size]``
    of a 1-D array of its dtype, or (None, None)."""
    owner = flat.base
    if (not isinstance(owner, np.ndarray) or owner.dtype != flat.dtype or owner.ndim != 1
            or not owner.flags.c_contiguous or not flat.flags.c_contiguous):
        return None, None
    start, rest = divmod(flat.ctypes.data - owner.ctypes.data, flat.itemsize)
    if rest or not 0 <= start <= owner.size - flat.size:
        return None, None
    return owner, start


def joined(flats):
    """The 1-D arrays ``flats`` as one array, when they lie back to back in
    one allocation (or are just one); else None."""
    if len(flats) == 1:
        return flats[0]
    owner, start = _extent(flats[0])
    stop = start
    for flat in flats:
        base, at = _extent(flat)
        if owner is None or base is not owner or at != stop:
            return None
        stop += flat.size
    return owner[start:stop]

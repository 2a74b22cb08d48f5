"""The MPI sum backend: each message run is summed by MPI's Allreduce in place,
in pieces of at most ``chunk_bytes``.

Pieces are queued and sent one non-blocking Allreduce at a time, the next
started whenever the previous one is found done (on submit, on progress, in
complete): MPICH runs many outstanding Iallreduce calls much slower than the
same calls one after another (docs/performance.md, "Why the defaults"). With
the bfloat16 wire (float32 pieces as a WireSum: an Alltoallv, a local sum, an
Allgatherv) up to ``wire.WINDOW`` pieces are in flight. A
blocking call submits every run and completes at once; an overlapped one
submits each run as backward finishes its gradients.
"""

import functools
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._base.address import address
from .._base.arena import Arena
from .._base.ranges import shard_range
from .._comm.communicator import Communicator, Started
from . import Settler
from .flight import Sums

__all__ = ["MpiBackend", "MpiShards", "extent", "joined"]


class MpiBackend:
    """Sums runs of buckets through the Communicator ``comm`` (watched)."""

    incremental = True
    name = "mpi"
    reads_apart = False
    sums_half = False
    in_node_memory = False

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def start(self, overlapped: bool, wire: Optional[str]) -> "_MpiSum":
        """Begin one call's sum (overlapped: progressed from a thread too)."""
        return _MpiSum(self.comm, wire, overlapped)


def _naming(first: int, last: int, members: Sequence[np.ndarray]) -> Callable[[], str]:
    """What a run's message is called in a stall diagnostic (evaluated only then)."""
    def what() -> str:
        buckets = f"buckets {first}-{last}" if last > first else f"bucket {first}"
        return (f"Allreduce of {buckets} ({sum(m.nbytes for m in members)} bytes, "
                f"{members[0].dtype.name})")
    return what


class _MpiSum:
    """One call's runs: their pieces queued, one Iallreduce in flight (with the
    wire, up to WINDOW pieces), each piece settled as soon as it is summed,
    while it is in cache (a pass over the results afterwards would cost as
    much as a copy)."""

    def __init__(self, comm: Communicator, wire: Optional[str], overlapped: bool) -> None:
        self.sums = Sums(comm, wire, poll=overlapped)
        # (members, their copy) of the runs whose memory is not back to back
        self.copies: List[Tuple[Sequence[np.ndarray], np.ndarray]] = []
        self.settle: Optional[Settler] = None        # known from complete() on
        # (first bucket, offset, piece): summed before complete() (overlapped calls)
        self.early: List[Tuple[int, int, np.ndarray]] = []
        self.lock = threading.Lock()     # the poller of an overlapped call settles too

    def submit(self, first: int, last: int, members: Sequence[np.ndarray],
               sources: Sequence[Optional[np.ndarray]]) -> None:
        run = joined(members)
        if run is None:         # this rank's memory of the run is not back to back: a copy
            run = np.concatenate(members)
            self.copies.append((members, run))
        what = _naming(first, last, members)
        for lo, hi in self.sums.cuts(run):
            self.sums.add(run[lo:hi], what, functools.partial(self._summed, first, lo, run[lo:hi]))
        self.sums.progress()

    def _summed(self, first: int, lo: int, piece: np.ndarray) -> None:
        """[lo, lo + piece.size) of the run from bucket ``first`` on is summed (its
        buckets lie side by side in their arena, so it is a part of ``first``'s)."""
        with self.lock:
            if self.settle is None:
                self.early.append((first, lo, piece))
            else:
                self.settle.part(first, lo, piece)

    def progress(self) -> None:
        self.sums.progress()

    def complete(self, settle: Settler) -> None:
        with self.lock:
            self.settle = settle
            for first, lo, piece in self.early:
                settle.part(first, lo, piece)
            self.early.clear()
        self.sums.finish()
        for members, copy in self.copies:
            offset = 0
            for flat in members:
                flat[...] = copy[offset:offset + flat.size]
                offset += flat.size


class MpiShards:
    """Moves the shards of the fused space through the Communicator ``comm``:
    each run of packed buckets goes out as one Reduce_scatter as soon as it
    is submitted, of which every rank receives the part in its shard; the
    shards are gathered back by one Allgatherv per arena."""

    incremental = True
    name = "mpi"

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def scatter(self, arenas: Dict[np.dtype, Arena],
                shards: Dict[np.dtype, np.ndarray]) -> "_MpiScatter":
        """Begin one reduce-scatter (ShardBackend)."""
        return _MpiScatter(self.comm, arenas, shards)

    def gather(self, arena: Arena, shard: Optional[np.ndarray]) -> None:
        """Fill ``arena``'s arrays with every rank's shard (ShardBackend),
        through the staging memory."""
        comm, n = self.comm, arena.size
        if shard is None:        # this rank's elements, out of its arrays
            lo, hi = shard_range(n, comm.rank, comm.size)
            arena.stage_range(lo, hi)
            shard = arena.staging[lo:hi].copy()
        counts = [hi - lo for lo, hi in (shard_range(n, r, comm.size) for r in range(comm.size))]
        comm.allgatherv(shard, counts, f"Allgatherv of the {arena.dtype.name} shards "
                        f"({n} elements)", arena.staging)
        arena.unstage_all()


class _MpiScatter:
    """One reduce-scatter through MPI (a Scattering)."""

    def __init__(self, comm: Communicator, arenas: Dict[np.dtype, Arena],
                 shards: Dict[np.dtype, np.ndarray]) -> None:
        self.comm = comm
        self.shards = shards
        self.started: List[Started] = []
        # dtype -> this rank's [lo, hi) of its arena
        self.ranges = {dtype: shard_range(arena.size, comm.rank, comm.size)
                       for dtype, arena in arenas.items()}

    def submit(self, arena: Arena, start: int, stop: int) -> None:
        """Reduce-scatter [start, stop) of ``arena``'s staging memory; this
        rank's part of it lands at its place in the shard."""
        comm, dtype = self.comm, arena.dtype
        ranges = [shard_range(arena.size, r, comm.size) for r in range(comm.size)]
        lo, hi = self.ranges[dtype]
        counts = [max(0, min(stop, b) - max(start, a)) for a, b in ranges]
        into = self.shards[dtype][max(start, lo) - lo:max(min(stop, hi), lo) - lo]
        self.started.append(comm.start_reduce_scatter(
            arena.staging[start:stop], into, counts,
            f"Reduce_scatter of {dtype.name} elements {start}-{stop} "
            f"({(stop - start) * dtype.itemsize} bytes)"))

    def complete(self, settle: Settler) -> None:
        for started in self.started:
            self.comm.wait(started)
        for dtype, shard in self.shards.items():
            settle.piece(dtype, self.ranges[dtype][0], shard)


def extent(flat: np.ndarray) -> Tuple[Optional[np.ndarray], int]:
    """(owner, start): ``flat`` as the slice ``owner[start:start + flat.size]``
    of a 1-D array of its dtype, or (None, -1)."""
    owner = flat.base
    if (not isinstance(owner, np.ndarray) or owner.dtype != flat.dtype or owner.ndim != 1
            or not owner.flags.c_contiguous or not flat.flags.c_contiguous):
        return None, -1
    start, rest = divmod(address(flat) - address(owner), flat.itemsize)
    if rest or not 0 <= start <= owner.size - flat.size:
        return None, -1
    return owner, start


def joined(flats: Sequence[np.ndarray]) -> Optional[np.ndarray]:
    """The 1-D arrays ``flats`` as one array, when they lie back to back in
    one allocation (or are just one); else None."""
    if len(flats) == 1:
        return flats[0]
    owner, start = extent(flats[0])
    if owner is None:
        return None
    stop = start
    for flat in flats:
        base, at = extent(flat)
        if base is not owner or at != stop:
            return None
        stop += flat.size
    return owner[start:stop]

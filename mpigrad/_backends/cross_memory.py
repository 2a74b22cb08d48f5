"""Node sums through cross-memory attach: no shared segment, whatever memory
the caller handed in.

Linux lets a process read and write another's memory when both run as the
same user (``process_vm_readv`` / ``process_vm_writev``; MPI libraries use it
for large messages). Each call, the ranks of a node exchange the addresses of
their buckets' memory (the gradients themselves where a bucket lies in one,
else its packed buffer or result span: whatever the pipeline staged). Each
local rank then sums its 1/L slice of every bucket: it reads that slice of
every peer's memory piece by piece (cache-sized), adds the pieces in local
rank order, folds in the mean and the finite check while the piece is in
cache, and writes the summed piece into every peer's memory and its own.
Only one rank computes each element, so results are bitwise equal everywhere
and do not depend on timing. Each rank reads and writes its data once, as a
memory copy does. Across nodes the slice is first summed on the node, then
among the ranks that own it on every node (an Allreduce on the cross-node
communicator), then pushed. The address exchange is the entry barrier (every
rank's memory staged); one Allreduce over the communicator ends the call
(every slice pushed: the addresses are valid for exactly the call), which
also agrees whether every rank's moves succeeded: a move the kernel refused,
or one into a process that ended, raises PeerError on every rank, naming it.
"""

import ctypes
import errno
import os
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._base.address import address as address_of
from .._base.dtypes import assign
from .._base.fused_sum import fused_sum
from .._base.huge_pages import MIN_BYTES, advise, prefer_huge_faults
from .._base.libc import LIBC
from .._base.errors import PeerError
from .._base.ranges import shard_range
from .._base.arena import Arena
from .._comm.communicator import Communicator
from .._comm.tally import TALLY
from . import Ranges, Settler
from .mpi import extent, joined
from .node_groups import NodeGroups
from .node_sum import sum_slice

__all__ = ["CrossMemory", "OverlappedCrossMemory", "Mover", "cross_memory_problem"]

# one summed piece: 1 MiB pieces (2 live ones fit this machine's 1 MiB L2
# per core only just) beat 256 KiB ones by 1.68 to 1.33 times a memory copy
# for ResNet-50 at 2 ranks: each piece costs two system calls and their page
# pinning, which larger pieces amortise
_PIECE_BYTES = 1 << 20
# the peers' pieces of a fused sum, in all: a whole piece each up to 5 local ranks,
# smaller beyond
_SPARES_BYTES = 4 << 20
# a slice summed into memory of its own (a reduce-scatter's shard, pushed nowhere) of
# this size or more is written past the cache (fused_sum's stream): its lines are not
# read in first; the torch backend's reduce_scatter_tensor of 100 MB at 2 ranks, 9.4-10.1
# -> 8.4-8.7 ms (the kernel's part 5.1-5.3 -> 4.0-4.1). Smaller shards stay in the cache
# for whatever reads them next (FSDP2's optimizer step)
_STREAM_BYTES = 8 << 20


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_CALLS = {}
for _name in ("process_vm_readv", "process_vm_writev"):
    _call = getattr(LIBC, _name, None)
    if _call is not None:
        _call.restype = ctypes.c_ssize_t
        _call.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                          ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        _CALLS[_name] = _call


class Mover:
    """Moves bytes between this process's arrays and another process's memory.

    Args:
        keep_going: a move that fails (the kernel refuses, the process ended)
            is kept in ``failure`` instead of raised, and every later move is
            skipped: the call goes on through its collectives, so that its
            peers are not left waiting, and ends with the failure agreed.
            ``halt`` skips them the same way, for a reason of the caller's.
    """

    def __init__(self, keep_going: bool = False) -> None:
        self.keep_going = keep_going
        self.failure: Optional[Tuple[int, OSError]] = None   # (pid, error) of the first
        self.halted: Optional[str] = None                    # why nothing more moves
        self.local = _IoVec()
        self.remote = _IoVec()
        self.local_ref = ctypes.byref(self.local)
        self.remote_ref = ctypes.byref(self.remote)

    def clear(self) -> None:
        """Forget an earlier call's failure and halt (one left by an error before its
        end): a call begins."""
        self.failure = self.halted = None

    def halt(self, reason: str) -> None:
        """Move nothing more (until ``failure`` and ``halted`` are cleared): this
        rank's addresses of its peers cannot be trusted, for ``reason``."""
        if self.halted is None:
            self.halted = reason

    def read(self, pid: int, address: int, into: np.ndarray) -> None:
        """Fill the contiguous array ``into`` from ``pid``'s memory at ``address``."""
        self._move(_CALLS["process_vm_readv"], pid, address_of(into), address, into.nbytes)

    def write(self, pid: int, address: int, data: np.ndarray) -> None:
        """Write the contiguous array ``data`` into ``pid``'s memory at ``address``."""
        self._move(_CALLS["process_vm_writev"], pid, address_of(data), address, data.nbytes)

    def _move(self, call: Any, pid: int, local: int, remote: int, nbytes: int) -> None:
        if self.failure is not None or self.halted is not None:
            return
        done = 0
        while done < nbytes:
            self.local.base, self.local.len = local + done, nbytes - done
            self.remote.base, self.remote.len = remote + done, nbytes - done
            moved = call(pid, self.local_ref, 1, self.remote_ref, 1, 0)
            if moved <= 0:
                code = ctypes.get_errno()
                error = OSError(code, os.strerror(code) if code else "nothing moved")
                if not self.keep_going:
                    raise error
                self.failure = (pid, error)
                return
            done += moved
        TALLY.moved += nbytes


def cross_memory_problem(groups: NodeGroups) -> Optional[str]:
    """Why the ranks cannot read each other's memory (None if they can),
    agreed by every rank of the communicator (collective): each local rank
    reads a token out of the next local rank's memory (a restrictive ptrace
    policy or seccomp profile refuses with EPERM, an old kernel with ENOSYS)."""
    problem = None
    if len(_CALLS) < 2:
        problem = "process_vm_readv/process_vm_writev are not in this C library"
    token = np.array([os.getpid() * 7919 + groups.local_rank], np.int64)
    table = groups.allgather_node([os.getpid(), token.ctypes.data, token[0]],
                                  "exchange of cross-memory probes")
    peer = (groups.local_rank + 1) % groups.local_size
    if problem is None and peer != groups.local_rank:
        got = np.zeros(1, np.int64)
        try:
            Mover().read(int(table[peer, 0]), int(table[peer, 1]), got)
            if got[0] != table[peer, 2]:
                problem = f"read {got[0]} out of local rank {peer}'s memory, not its token"
        except OSError as exc:
            problem = f"process_vm_readv of local rank {peer}'s memory failed: {exc}"
    # the agreement also keeps every token alive until every rank has read
    if groups.agree_all(problem is None, "cross-memory probe"):
        return None
    return groups.reasons(problem)


#: an exchange of addresses' row: this rank's pid and the exchange's number, then per
#: region its target's address, its source's, its bytes and the region it continues
_ROW_HEAD, _REGION_VALUES = 2, 4


def _region_column(k: int) -> int:
    """The column of region ``k``'s first value (its target's address) in a row."""
    return _ROW_HEAD + _REGION_VALUES * k


class CrossMemory:
    """The cross-memory sum backend of a Reducer's node (see the module).

    Args:
        groups: the Reducer's NodeGroups.
    """

    #: every bucket (and arena) is summed at once, in ``complete``
    incremental = False
    name = "cross-memory"
    reads_apart = True
    sums_half = True
    in_node_memory = False

    def __init__(self, groups: NodeGroups) -> None:
        self.groups = groups
        self.mover = Mover(keep_going=True)
        # the local ranks as ranks of the Reducer's communicator (errors name them)
        self.ranks = groups.node_ranks()
        # one piece read from a peer, and one summed apart: kept from call to
        # call (fresh memory would page-fault in every call)
        self.incoming = np.empty(_PIECE_BYTES, np.uint8)
        self.scratch = np.empty(_PIECE_BYTES, np.uint8)
        self.spares = np.empty(0, np.uint8)        # the peers' pieces of a fused sum
        self.exchanges = 0          # exchanges of addresses made (table), the same everywhere

    def start(self, overlapped: bool, wire: Optional[str]) -> "_CrossSum":
        """Begin one call's sum."""
        return _CrossSum(self, wire)

    @property
    def whole(self) -> bool:
        """Whether the node holds every rank of the communicator, in order
        (then its slices are the communicator's shards: Reducer.shards)."""
        return self.ranks == list(range(len(self.ranks))) and self.groups.nodes == 1

    def slice_of(self, n: int, local: Optional[int] = None) -> Tuple[int, int]:
        """[start, stop) of ``n`` elements that local rank ``local`` (default
        this rank) sums."""
        local = self.groups.local_rank if local is None else local
        return shard_range(n, local, self.groups.local_size)

    def table(self, regions: Sequence[Tuple[np.ndarray, np.ndarray]], what: str,
              extents: Optional[List[int]] = None,
              lasting: bool = True) -> Tuple[List[int], List["_Peers"]]:
        """(every local rank's pid, per region: the local ranks' _Peers) for
        ``regions`` ((target, source) pairs, of the same sizes on every local
        rank, or of ``extents[local rank]`` bytes: checked). A region whose
        target and source continue an earlier region's in one array, the same one
        on every local rank, names it (``after``). This rank's regions that last go
        onto huge pages (mpigrad._base.huge_pages), where the peers move them
        faster; ``lasting=False``: the regions are made anew for each call (a
        reduce-scatter's input and an all-gather's output: FSDP2 and torch's
        gradients allocate them each step, often at the address the last one
        freed), and none is counted."""
        # a row: this rank's pid, the exchange's number, then _REGION_VALUES a region
        mine = [os.getpid(), self.exchanges] + [value for (target, source), after
                                                in zip(regions, _continues(regions))
                                                for value in (address_of(target),
                                                              address_of(source),
                                                              target.nbytes, after)]
        for k, (target, source) in enumerate(regions):       # the peers' moves: on huge
            if lasting and target.nbytes >= MIN_BYTES:         # pages where they last
                at = _region_column(k)
                advise(mine[at], target.nbytes)
                if source is not target:
                    advise(mine[at + 1], source.nbytes)
        table = self.groups.allgather_node(mine, what)
        self._check_exchange(table[:, 1], what)
        pids = [int(p) for p in table[:, 0]]
        peers: List[_Peers] = []
        for k, (target, _) in enumerate(regions):
            at = _region_column(k)
            targets, sources, sizes, after = (table[:, at + i] for i in range(_REGION_VALUES))
            want = [target.nbytes] * len(pids) if extents is None else extents
            if sizes.tolist() != want:     # (perhaps on this rank's table alone)
                self.mover.halt(f"{what}: region {k}: expecting {want} bytes on the local "
                                f"ranks, got {sizes.tolist()}, so no memory is moved on "
                                "these addresses")
            peers.append(_Peers(pids, [int(a) for a in targets], [int(a) for a in sources],
                                int(after[0]) if (after == after[0]).all() else -1))
        return pids, peers

    def _check_exchange(self, numbers: np.ndarray, what: str) -> None:
        """Every local rank's row of an exchange of addresses carries the exchange's
        number (each rank counts its exchanges, which every local rank makes in one
        order): a row of another exchange is a message the MPI library misdelivered,
        and its addresses are not the ones to move (Open MPI 5.0.x's shared-memory
        transport, under load: open-mpi/ompi#12816, #12979). This rank then moves
        nothing (``Mover.halt``) but stays in the call to its end, where every rank
        raises PeerError naming it (``finish_call``): its peers, whose tables are
        right, move its memory meanwhile, which must stay valid until they are done
        (a rank that left the call at once could free it under their writes)."""
        expected, self.exchanges = self.exchanges, self.exchanges + 1
        if (numbers == expected).all():
            return
        self.mover.halt(
            f"{what}: expecting every local rank's row of exchange {expected}, got rows of "
            f"exchanges {numbers.tolist()} (local ranks in order): the MPI library "
            "delivered a stale or misrouted message, so no memory is moved on these "
            "addresses. Open MPI 5.0.x's shared-memory transport does this under load "
            "(open-mpi/ompi#12816, #12979): run with --mca btl self,tcp, "
            "cross_memory=False, or another MPI library")

    def finish_call(self, pids: List[int], what: str, settle: Optional[Settler] = None) -> None:
        """End a call: one Allreduce over the communicator, which is also the
        node barrier after the moves (the addresses exchanged stay valid until
        every rank is here), agrees whether every rank's moves succeeded and,
        with ``settle``, the finite flag (each rank checked its slices). A
        move that failed anywhere, or a rank that halted its moves, raises
        PeerError on every rank, naming the rank and why (EPERM: the kernel
        refuses; a table of addresses it could not trust)."""
        mover = self.mover
        finite = None if settle is None else settle.finite
        flags = np.array([mover.failure is None and mover.halted is None, finite is not False],
                         np.int64)
        self.groups.communicator.allreduce(flags, "min", what)
        if not flags[0]:
            failure, halted = mover.failure, mover.halted
            mover.failure = mover.halted = None
            report = halted if halted is not None else (
                None if failure is None else self._report(pids, *failure))
            reports = self.groups.communicator.allgather_reports(report)
            failed = [r for r, m in enumerate(reports) if m is not None]
            raise PeerError(failed, [m for m in reports if m is not None],
                            "the cross-memory sum failed on")
        if settle is not None:
            settle.agree(lambda _: bool(flags[1]))

    def _report(self, pids: List[int], pid: int, error: OSError) -> str:
        """What failed, for the PeerError every rank raises."""
        peer = self.ranks[pids.index(pid)] if pid in pids else f"(pid {pid})"
        why = {errno.EPERM: "the kernel refuses cross-memory attach now (a ptrace policy or "
                            "seccomp rule): run with cross_memory=False",
               errno.ESRCH: "its process ended"}.get(error.errno or 0, "")
        code = errno.errorcode.get(error.errno or 0, "an error")
        return f"moving rank {peer}'s memory failed with {code} ({error})" + (
            f": {why}" if why else "")

    def reduce(self, buckets: Sequence[Tuple[int, np.ndarray, np.ndarray]],
               settle: Settler, wire: Optional[str]) -> None:
        """Sum ``buckets`` ((index, this rank's 1-D memory for the sum, the
        memory its addend is read from: the same or apart) triples, the same
        indices on every rank) over the node and across nodes into every
        rank's memory, settled by ``settle``; the finite flag is then agreed
        over all ranks (each rank checked its own slices); across nodes through ``wire``."""
        self.mover.clear()
        pids, peers = self.table([(target, source) for _, target, source in buckets],
                                 "exchange of bucket addresses (cross-memory sum)")
        if self.groups.nodes > 1:       # the runs decide which pieces cross the link
            _agree_runs(self.groups.communicator, peers)
        for members, region in _message_runs(buckets, peers):
            # buckets side by side in one array on every rank: one region, sliced
            # whole (fewer, larger moves; issue 21), each piece settled bucket by bucket
            target = joined([t for _, t, _ in members])
            source = joined([s for _, _, s in members])
            assert target is not None and source is not None      # (each one's after)
            parts = [(i, t.size) for i, t, _ in members]
            start, stop = self.slice_of(target.size)
            if target.dtype.itemsize == 2 or (target.dtype == np.float32
                                               and self.groups.nodes == 1):
                # half precision (Where.HALF) and float32 on one node: one fused pass a piece
                self.fused_slice_of(target, source, region, start, stop, settle,
                                    _part_ranges(settle, parts), push=True, wire=wire)
            else:
                self.sum_slice_of(target, source, region, start, stop,
                                  partial(_settle_parts, settle, parts), push=True, wire=wire)
        self.finish_call(pids, "end of the cross-memory sum (every slice pushed)", settle)

    def scatter(self, arenas: Dict[np.dtype, Arena],
                shards: Dict[np.dtype, np.ndarray]) -> "_CrossScatter":
        """Begin a reduce-scatter of ``arenas`` into ``shards`` (ShardBackend;
        every arena is summed in ``complete``, read where it lies)."""
        return _CrossScatter(self, arenas, shards)

    def gather(self, arena: Arena, shard: Optional[np.ndarray]) -> None:
        """Fill ``arena``'s arrays with every rank's shard (ShardBackend): read
        out of the peers' ``shard``, or with None out of the peers' arrays,
        where each rank's shard already is; staging only the arrays that
        cannot be read and written as they are."""
        parts, staged = arena.parts(writes=True)
        if shard is None:            # the staged arrays' own slices, where the peers read
            arena.fill(staged)
        self.gather_parts(parts, shard)
        arena.unstage(staged)

    def scatter_sum(self, parts: Sequence[np.ndarray], settle: Settler, dtype: np.dtype,
                    out: np.ndarray) -> None:
        """Sum the ``dtype`` arena made of ``parts`` (1-D arrays side by side, the same
        sizes on every local rank: the caller's gradients where they can be read as
        they are, else packed copies) over the node, which holds the whole
        communicator (``whole``), into ``out`` (1-D, of this rank's slice's size),
        settled at its place in the arena (float32: in the fused pass): the node sum
        without the push."""
        self.mover.clear()
        pids, peers = self.table([(part, part) for part in parts],
                                 "exchange of gradient addresses (cross-memory reduce-scatter)",
                                 lasting=False)
        start, stop = self.slice_of(sum(part.size for part in parts))
        shard = out
        prefer_huge_faults(address_of(out), out.nbytes)       # FSDP2's: new each step
        for k, lo, hi, at in _segments([part.size for part in parts], start, stop):
            first = start + at          # its place in the arena
            region = peers[k].shifted(lo * parts[k].itemsize)
            if out.dtype == np.float32:
                self.fused_slice_of(shard[at:at + hi - lo], parts[k][lo:hi], region, 0, hi - lo,
                                    settle, _arena_ranges(settle, dtype, first), push=False)
            else:
                self.sum_slice_of(shard[at:at + hi - lo], parts[k][lo:hi], region, 0, hi - lo,
                                  _from(first, partial(settle.piece, dtype)), push=False)
        self.finish_call(pids, "end of the cross-memory reduce-scatter (every slice read)")

    def gather_parts(self, parts: Sequence[np.ndarray],
                     shard: Optional[np.ndarray] = None) -> None:
        """Fill the arena made of ``parts`` (1-D writable arrays side by side,
        the same sizes on every local rank) with every local rank's slice of
        it (``whole``): read out of the peers' ``shard`` (this rank's slice,
        contiguous), or without one out of the peers' own ``parts``, where
        each rank's slice already is."""
        self.mover.clear()
        sizes = [part.size for part in parts]
        n, local = sum(sizes), self.groups.local_rank
        if shard is None:
            pids, peers = self.table([(part, part) for part in parts], "exchange of "
                                     "parameter addresses (cross-memory allgather)",
                                     lasting=False)
        else:
            counts = [(hi - lo) * shard.itemsize for lo, hi in
                      (self.slice_of(n, r) for r in range(self.groups.local_size))]
            pids, (theirs,) = self.table([(shard, shard)], "exchange of shard addresses "
                                         "(cross-memory allgather)", counts, lasting=False)
        for rank in range(self.groups.local_size):
            for k, lo, hi, at in _segments(sizes, *self.slice_of(n, rank)):
                into = parts[k][lo:hi]
                if shard is None:
                    if rank != local:
                        self.mover.read(pids[rank], peers[k].targets[rank]
                                        + lo * into.itemsize, into)
                elif rank == local:
                    into[...] = shard[at:at + hi - lo]
                else:
                    self.mover.read(pids[rank], theirs.targets[rank] + at * into.itemsize,
                                    into)
        self.finish_call(pids, "end of the cross-memory allgather (every shard read)")

    def sum_slice_of(self, target: np.ndarray, source: np.ndarray, peers: "_Peers", start: int,
                     stop: int, settle: Callable[[int, np.ndarray], None], push: bool,
                     wire: Optional[str] = None) -> None:
        """Sum [start, stop) over the local ranks into ``target``, each piece
        settled by ``settle(first, piece)``; with ``push``, written into every
        local rank's target too (across nodes: first summed over the nodes,
        through ``wire``)."""
        if start == stop:
            return
        groups, local = self.groups, self.groups.local_rank
        across = groups.nodes > 1 and push
        step = max(1, _PIECE_BYTES // target.itemsize)
        itemsize = source.itemsize
        addend = self.addends(source, peers)

        def finish(lo: int, piece: np.ndarray) -> None:
            if not across:
                settle(lo, piece)
                if push:
                    self.push(target, lo, lo + piece.size, peers)

        def node_sum(lo: int, hi: int) -> None:
            sum_slice(target, lo, hi, local, len(peers.pids), addend,
                      self.incoming[:step * itemsize].view(target.dtype),
                      self.scratch[:step * itemsize].view(target.dtype), finish)

        def summed(lo: int, hi: int) -> None:     # across the nodes too
            settle(start + lo, target[start + lo:start + hi])
            self.push(target, start + lo, start + hi, peers)

        if across:      # each piece's node sum, then its way across, the next summed meanwhile
            groups.sum_across(target[start:stop], "Allreduce across nodes of a node's slice",
                              wire, summed, lambda lo, hi: node_sum(start + lo, start + hi))
        else:
            node_sum(start, stop)

    def fused_slice_of(self, target: np.ndarray, source: np.ndarray, peers: "_Peers",
                       start: int, stop: int, settle: Settler,
                       ranges: Callable[[int, int], Ranges], push: bool,
                       wire: Optional[str] = None) -> None:
        """sum_slice_of in one fused pass a piece (fused_sum), for float32 memory or
        half-precision memory (Where.HALF): each piece's addends read (half precision:
        half the bytes of float32 staging), then summed in float32, settled (the mean
        and limit of each of ``ranges(first, last)``: target positions) and, for half
        precision, rounded once into ``target``; with ``push``, written into the peers'
        too (without, a slice of _STREAM_BYTES or more is written past the cache): the
        same bits as the passes it fuses. Half precision across nodes: the
        node's float32 sums go across first, then are settled in place by the same
        kernel (float32 across nodes takes sum_slice_of)."""
        if start == stop:
            return
        groups = self.groups
        wide = np.empty(stop - start, np.float32) if groups.nodes > 1 else None
        stream = not push and (stop - start) * target.itemsize >= _STREAM_BYTES

        def node_sum(lo: int, hi: int) -> None:
            for first, last, addends in self.pieces(source, peers, lo, hi):
                if wide is not None:
                    fused_sum(wide[first - start:last - start], addends)
                    continue
                settled(target, 0, first, last, addends, stream)
                if push:
                    self.push(target, first, last, peers)

        def settled(into: np.ndarray, offset: int, first: int, last: int,
                    addends: Sequence[np.ndarray], stream: bool = False) -> None:
            """Target positions [first, last), held in ``into`` from position ``offset``
            on, = the sum of ``addends`` (pieces at ``first``), settled range by range;
            ``stream``: written past the cache (a shard: nothing reads it back here)."""
            for a, b, factor, limit in ranges(first, last):
                settle.note(fused_sum(into[a - offset:b - offset],
                                      [x[a - first:b - first] for x in addends], factor, limit,
                                      stream))

        def summed(lo: int, hi: int) -> None:     # across the nodes too: settled in place
            assert wide is not None
            settled(wide, start, start + lo, start + hi, [wide[lo:hi]])
            assign(target[start + lo:start + hi], wide[lo:hi])
            self.push(target, start + lo, start + hi, peers)

        if wide is not None:    # each piece's node sum, then its way across (float32)
            groups.sum_across(wide, "Allreduce across nodes of a node's slice", wire, summed,
                              lambda lo, hi: node_sum(start + lo, start + hi))
        else:
            node_sum(start, stop)

    def combine(self, regions: Sequence[Tuple[np.ndarray, np.ndarray]],
                kernel: Callable[[Sequence[np.ndarray], np.ndarray], None], what: str,
                lasting: bool = True) -> None:
        """Combine ``regions`` ((target, source) pairs of 1-D arrays of one dtype, the
        same sizes on every local rank) over the node, which holds the whole
        communicator (``whole``), by ``kernel(addends, into)``: each local rank
        computes its slice of each region into its ``target``, a piece ``into`` at a
        time, from the local ranks' addends of that piece in their order, and writes
        it into every local rank's target; the end agreed as a sum's (finish_call).
        ``lasting``: as ``table``'s."""
        pids, peers = self.table(regions, f"exchange of addresses ({what})", lasting=lasting)
        for (target, source), region in zip(regions, peers):
            for first, last, addends in self.pieces(source, region, *self.slice_of(target.size)):
                kernel(addends, target[first:last])
                self.push(target, first, last, region)
        self.finish_call(pids, f"end of the {what} (every slice pushed)")

    def pieces(self, source: np.ndarray, peers: "_Peers", start: int, stop: int
               ) -> Iterator[Tuple[int, int, List[np.ndarray]]]:
        """(first, last, addends) for the pieces [first, last) of [start, stop) of the
        region whose memory on this rank is ``source``: the local ranks' addends of
        the piece in their order (this rank's a view of ``source``, the peers' read
        into the spare pieces: valid until the next piece)."""
        count, local = len(peers.pids), self.groups.local_rank
        step, spares = self.spare_pieces(count, source.dtype)
        addend = self.addends(source, peers)
        for first in range(start, stop, step):
            last = min(first + step, stop)
            spare = iter(spares)
            yield first, last, [addend(rank, first, last, None if rank == local
                                       else next(spare)[:last - first])
                                for rank in range(count)]

    def spare_pieces(self, count: int, dtype: np.dtype) -> Tuple[int, List[np.ndarray]]:
        """(elements a piece, one piece of ``dtype`` per peer of ``count`` local ranks) for
        the fused node sum: pieces of _PIECE_BYTES, _SPARES_BYTES in all at most, kept
        from call to call (fresh memory would page-fault in every call)."""
        size = dtype.itemsize
        step = max(4096, min(_PIECE_BYTES // size, _SPARES_BYTES // size // max(1, count - 1)))
        need = step * size * (count - 1)
        if self.spares.size < need:
            self.spares = np.empty(need, np.uint8)
        return step, list(self.spares[:need].view(dtype).reshape(max(count - 1, 0), step))

    def addends(self, source: np.ndarray, peers: "_Peers"
                ) -> Callable[[int, int, int, Optional[np.ndarray]], np.ndarray]:
        """The node sum's ``addend(rank, lo, hi, into)`` over ``source`` (this rank's)
        and the peers' memory: this rank's [lo, hi), or a peer's read into ``into``."""
        local, itemsize = self.groups.local_rank, source.itemsize

        def addend(rank: int, lo: int, hi: int, into: Optional[np.ndarray]) -> np.ndarray:
            if rank == local:
                return source[lo:hi]
            assert into is not None
            self.mover.read(peers.pids[rank], peers.sources[rank] + lo * itemsize, into)
            return into
        return addend

    def push(self, target: np.ndarray, lo: int, hi: int, peers: "_Peers") -> None:
        """Write the summed [lo, hi) into every other local rank's target."""
        piece = target[lo:hi]
        for rank, (pid, address) in enumerate(zip(peers.pids, peers.targets)):
            if rank != self.groups.local_rank:
                self.mover.write(pid, address + lo * target.itemsize, piece)


class _Peers:
    """Where the local ranks' memory of one bucket is: their processes, the
    memory their sums go to, the memory their addends are read from."""

    __slots__ = ("pids", "targets", "sources", "after")

    def __init__(self, pids: List[int], targets: List[int], sources: List[int],
                 after: int = -1) -> None:
        self.pids, self.targets, self.sources = pids, targets, sources
        self.after = after      # the earlier region this one continues everywhere, or -1

    def shifted(self, nbytes: int) -> "_Peers":
        """The same memory ``nbytes`` further on."""
        return _Peers(self.pids, [a + nbytes for a in self.targets],
                      [a + nbytes for a in self.sources])


def _continues(regions: Sequence[Tuple[np.ndarray, np.ndarray]]) -> List[int]:
    """Per region, the earlier region whose target and source it continues, each in
    one array (its index), or -1 (each array's place found once)."""
    ends: Dict[Tuple[int, int, int, int], int] = {}      # where a region's arrays end
    after = [-1] * len(regions)
    for k, (target, source) in enumerate(regions):
        owner, at = extent(target)
        apart, start = (owner, at) if source is target else extent(source)
        if owner is None or apart is None:
            continue
        after[k] = ends.pop((id(owner), at, id(apart), start), -1)
        ends[(id(owner), at + target.size, id(apart), start + source.size)] = k
    return after


def _agree_runs(comm: Communicator, peers: Sequence["_Peers"]) -> None:
    """Keep each region's ``after`` only where every rank of ``comm`` names the same
    one: a node's table is its own, and a run joined on one node but not on another
    would send other pieces across the link than theirs (one Allreduce)."""
    after = np.array([region.after for region in peers], np.int64)
    bounds = np.concatenate([after, -after])          # the least and, negated, the most
    comm.allreduce(bounds, "min", "agreement of the regions' runs (cross-memory sum)")
    for region, least, most in zip(peers, bounds[:len(peers)], -bounds[len(peers):]):
        if least != most:
            region.after = -1


Bucket = Tuple[int, np.ndarray, np.ndarray]


def _message_runs(buckets: Sequence[Bucket], peers: Sequence[_Peers]
                  ) -> List[Tuple[List[Bucket], _Peers]]:
    """The buckets as runs of neighbours in memory (each after the first continues the
    one before it: its ``after``), in the order of their first buckets, with the _Peers
    of each run's first bucket (where the run begins on every local rank)."""
    runs: List[Tuple[List[Bucket], _Peers]] = []
    tails: Dict[int, List[Bucket]] = {}       # region -> the run it ends
    for k, (bucket, region) in enumerate(zip(buckets, peers)):
        run = tails.pop(region.after, None)
        if run is None:
            run = []
            runs.append((run, region))
        run.append(bucket)
        tails[k] = run
    return runs


def _settle_parts(settle: Settler, parts: Sequence[Tuple[int, int]], lo: int,
                  piece: np.ndarray) -> None:
    """Settle ``piece``, [lo, lo + piece.size) of a run of buckets ``parts`` ((index,
    size) side by side), bucket by bucket."""
    for k, first, last, at in _segments([size for _, size in parts], lo, lo + piece.size):
        settle.part(parts[k][0], first, piece[at:at + last - first])


def _part_ranges(settle: Settler, parts: Sequence[Tuple[int, int]]
                 ) -> Callable[[int, int], Ranges]:
    """The settle ranges of target positions [first, last) of a run of buckets ``parts``
    ((index, size) side by side)."""
    sizes = [size for _, size in parts]

    def ranges(first: int, last: int) -> Ranges:
        return [(first + at + a - lo, first + at + b - lo, factor, limit)
                for k, lo, hi, at in _segments(sizes, first, last)
                for a, b, factor, limit in settle.part_ranges(parts[k][0], lo, hi)]
    return ranges


def _arena_ranges(settle: Settler, dtype: np.dtype, offset: int
                  ) -> Callable[[int, int], Ranges]:
    """The settle ranges of target positions [first, last), which lie ``offset`` into
    the ``dtype`` arena."""
    def ranges(first: int, last: int) -> Ranges:
        return [(a - offset, b - offset, factor, limit)
                for a, b, factor, limit in settle.ranges(dtype, offset + first, offset + last)]
    return ranges


def _from(first: int, settle: Callable[[int, np.ndarray], None]
          ) -> Callable[[int, np.ndarray], None]:
    """``settle`` of pieces placed ``first`` elements further on."""
    return lambda lo, piece: settle(first + lo, piece)


def _segments(sizes: Sequence[int], start: int, stop: int
              ) -> Iterator[Tuple[int, int, int, int]]:
    """(k, lo, hi, at): the parts of ``sizes`` side by side that [start, stop)
    of their arena covers: part k's [lo, hi), at ``at`` from ``start``."""
    offset = 0
    for k, size in enumerate(sizes):
        lo, hi = max(start - offset, 0), min(stop - offset, size)
        if lo < hi:
            yield k, lo, hi, offset + lo - start
        offset += size


class _CrossScatter:
    """One reduce-scatter through cross-memory attach (a Scattering): every
    arena in ``complete``, read out of the gradients where they can be read
    as they are."""

    def __init__(self, backend: CrossMemory, arenas: Dict[np.dtype, Arena],
                 shards: Dict[np.dtype, np.ndarray]) -> None:
        self.backend, self.arenas, self.shards = backend, arenas, shards

    def submit(self, arena: Arena, start: int, stop: int) -> None:
        """Nothing to do: not incremental."""

    def complete(self, settle: Settler) -> None:
        for dtype, arena in self.arenas.items():
            parts, staged = arena.parts(writes=False)
            arena.fill(staged)
            self.backend.scatter_sum(parts, settle, dtype, self.shards[dtype])


class _CrossSum:
    """One call's sum through cross-memory attach (a Summation)."""

    def __init__(self, backend: CrossMemory, wire: Optional[str]) -> None:
        self.backend, self.wire = backend, wire
        self.buckets: List[Tuple[int, np.ndarray, np.ndarray]] = []

    def submit(self, first: int, last: int, members: Sequence[np.ndarray],
               sources: Sequence[Optional[np.ndarray]]) -> None:
        """Keep the buckets' memory: every bucket is summed in ``complete``."""
        self.buckets.extend((i, member, member if source is None else source)
                            for i, member, source in zip(range(first, last + 1), members,
                                                         sources))

    def progress(self) -> None:
        """Nothing to do: the sum runs in ``complete``."""

    def complete(self, settle: Settler) -> None:
        """Sum every bucket over the node (and across nodes), settled."""
        self.backend.reduce(self.buckets, settle, self.wire)


class OverlappedCrossMemory:
    """The sum of an overlapped call (``Reducer.start``) across nodes, through
    cross-memory attach (a SumBackend): each message run's node sum as it is submitted
    (while backward goes on), its slice's way across the nodes in flight behind the
    rest of backward, the mean and the push into the peers in ``complete``. The same
    additions, in the same order, as CrossMemory's blocking sum."""

    incremental = True
    name = "cross-memory, overlapped"
    reads_apart = False
    sums_half = False
    in_node_memory = False

    def __init__(self, cross: CrossMemory) -> None:
        self.cross = cross

    def start(self, overlapped: bool, wire: Optional[str]) -> "_CrossRuns":
        """Begin one call's sum."""
        return _CrossRuns(self.cross, wire)


class _CrossRuns:
    """One overlapped call's sum through cross-memory attach across nodes (a Summation)."""

    def __init__(self, backend: CrossMemory, wire: Optional[str]) -> None:
        self.backend = backend
        backend.mover.clear()
        self.across = backend.groups.sums_across(wire, poll=True)
        # per bucket submitted: (its index, its memory, its peers' memory)
        self.buckets: List[Tuple[int, np.ndarray, _Peers]] = []
        self.pids: List[int] = []

    def submit(self, first: int, last: int, members: Sequence[np.ndarray],
               sources: Sequence[Optional[np.ndarray]]) -> None:
        """The node sum of this rank's slice of each bucket now (every local rank's
        gradients of them are final once the addresses are exchanged), its way across
        the nodes queued."""
        backend = self.backend
        self.pids, peers = backend.table([(m, m) for m in members], "exchange of bucket "
                                         "addresses (cross-memory sum, overlapped)")
        for i, member, region in zip(range(first, last + 1), members, peers):
            self.buckets.append((i, member, region))
            start, stop = backend.slice_of(member.size)
            backend.sum_slice_of(member, member, region, start, stop, _unsettled, push=False)
            what = f"Allreduce across nodes of a node's slice of bucket {i}"
            for lo, hi in self.across.cuts(member[start:stop]):
                self.across.add(member[start + lo:start + hi], what)
        self.across.progress()

    def progress(self) -> None:
        self.across.progress()

    def complete(self, settle: Settler) -> None:
        """Wait for the slices' way across, settle them, push them into the peers; the
        end of the call agreed (every slice pushed, every move succeeded)."""
        self.across.finish()
        backend = self.backend
        for i, member, region in self.buckets:
            start, stop = backend.slice_of(member.size)
            if start < stop:
                settle.part(i, start, member[start:stop])
                backend.push(member, start, stop, region)
        backend.finish_call(self.pids, "end of the overlapped cross-memory sum "
                            "(every slice pushed)", settle)


def _unsettled(lo: int, piece: np.ndarray) -> None:
    """A node sum's piece, settled only once summed across the nodes too."""

"""Backends: how the buckets of one call are summed over the ranks (the sum),
and how a wire dtype's arena is reduce-scattered and gathered back (the
shards). The engine (mpigrad._engine) decides which buckets, when, and where
they lie; a backend moves and sums them. This is the seam torch DDP's comm
hooks expose, kept inside the library:

- ``mpi.MpiBackend`` / ``mpi.MpiShards``: MPI's Allreduce in pieces of
  ``chunk_bytes``, one non-blocking call in flight at a time, each run summed
  as soon as it is submitted (the overlap with backward); Reduce_scatter of
  each run of packed buckets, Allgatherv of the shards.
- ``node_memory.SharedBuckets``: the node's ranks sum their buckets in memory
  they all map (each rank its slice), then across nodes through MPI; every
  arena at once, in ``complete``.
- ``cross_memory.CrossMemory``: the same slices, read out of and written into
  the peers' own memory (process_vm_readv/writev): no shared segment; on a
  node holding every rank, also the shards, read out of the gradients.

``select.select`` decides, once per Reducer, which of them it has, and per
call which one sums it. Imports run one way: the engine imports backends,
backends import ``_comm`` and ``_base``.
"""

from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from .._base.arena import Arena

__all__ = ["Settler", "Summation", "SumBackend", "Scattering", "ShardBackend", "Ranges"]

#: (lo, hi, the mean's factor or None, the finite limit or None) of an arena's elements
Ranges = List[Tuple[int, int, Optional[float], Optional[float]]]


class Settler(Protocol):
    """The engine's settle step of one call, as backends call it: the mean
    and the finite check of each summed piece, while it is in cache."""

    #: whether every value settled so far is finite (None: not checked)
    finite: Optional[bool]

    def ranges(self, dtype: np.dtype, lo: int, hi: int) -> Ranges:
        """[lo, hi) of the ``dtype`` arena cut where its finite limit changes: (lo,
        hi, the mean's factor or None, the limit or None), for a kernel that settles
        as it sums."""

    def part_ranges(self, i: int, lo: int, hi: int) -> Ranges:
        """``ranges`` of [lo, hi) of bucket ``i``, in the bucket's positions."""

    def note(self, finite: Optional[bool]) -> None:
        """Fold such a kernel's finite flag (None: not checked) into the call's."""

    def bucket(self, i: int, flat: np.ndarray) -> None:
        """Settle bucket ``i``'s summed 1-D memory ``flat``."""

    def part(self, i: int, lo: int, flat: np.ndarray) -> None:
        """Settle ``flat``, the summed [lo, lo + flat.size) of bucket ``i``."""

    def piece(self, dtype: np.dtype, offset: int, flat: np.ndarray) -> None:
        """Settle ``flat``, the summed [offset, offset + flat.size) of the
        ``dtype`` arena."""

    def agree(self, combine: Callable[[bool], bool]) -> None:
        """Replace the finite flag by ``combine(flag)`` (each rank checked a
        part: the flags agreed over all ranks)."""


class Summation(Protocol):
    """One call's sum in progress."""

    def submit(self, first: int, last: int, members: Sequence[np.ndarray],
               sources: Sequence[Optional[np.ndarray]]) -> None:
        """Sum buckets ``first``..``last`` (their 1-D memory ``members``) as one
        message run; every rank submits the same runs in the same order.
        ``sources``: per member, None (the member holds this rank's addend),
        or where the addend is read from (a backend without ``reads_apart``
        is never given one)."""

    def progress(self) -> None:
        """Move submitted runs on without blocking."""

    def complete(self, settle: Settler) -> None:
        """Finish every submitted run and settle (mean, finite check) each
        summed bucket through ``settle``."""


class SumBackend(Protocol):
    """What sums the dense buckets of a call."""

    #: whether runs are summed as they are submitted (overlap pays), or all
    #: together in ``complete``
    incremental: bool
    #: what the Reducer reports as the call's backend
    name: str
    #: whether a bucket's addend may be read from memory other than where its
    #: sum is written (Where.APART)
    reads_apart: bool
    #: whether a bucket may come as half-precision memory (a plain reduce's
    #: float16/bfloat16 results): summed in float32, written back rounded once
    sums_half: bool
    #: whether every bucket is summed where the node's ranks all map it (its
    #: buffers in node memory: each bucket a message of its own)
    in_node_memory: bool

    def start(self, overlapped: bool, wire: Optional[str]) -> Summation:
        """Begin one call's sum (``overlapped``: a start(), its runs submitted as
        backward finishes them; ``wire``: what its float32 buckets travel as
        between ranks, ``wire.wire_for``)."""


class Scattering(Protocol):
    """One reduce-scatter in progress: each rank receives its shard of every
    wire dtype's arena (shard_range) into ``shards[dtype]``."""

    def submit(self, arena: Arena, start: int, stop: int) -> None:
        """(``incremental`` backends) elements [start, stop) of ``arena`` are
        packed in its staging memory: reduce-scatter them now."""

    def complete(self, settle: Settler) -> None:
        """Finish: every arena summed into the shards, each shard settled
        (``settle.piece``, at its place in the arena)."""


class ShardBackend(Protocol):
    """What moves the shards of the fused space (a sharded optimizer step)."""

    #: what the Reducer reports as the call's backend
    name: str
    #: whether runs are reduce-scattered as they are submitted (packed in
    #: staging memory), or every arena in ``complete``, read where it lies
    incremental: bool

    def scatter(self, arenas: Dict[np.dtype, Arena],
                shards: Dict[np.dtype, np.ndarray]) -> Scattering:
        """Begin one reduce-scatter of ``arenas`` into this rank's ``shards``."""

    def gather(self, arena: Arena, shard: Optional[np.ndarray]) -> None:
        """Fill ``arena``'s arrays with every rank's shard: from the ranks'
        ``shard`` (this rank's, 1-D), or with None out of the arrays
        themselves, where each rank's shard already is."""

"""Sum backends: how the dense buckets of one call are summed over the ranks.

The pipeline (mpigrad._engine.pipeline) stages every bucket's memory, then
hands it to a backend in message runs (consecutive buckets summed as one
message, agreed by every rank) and finally asks it to complete the call. A
backend is the seam between "which buckets, when" and "how they are summed"
(torch DDP's comm hooks, inside the library):

- ``mpi.MpiBackend``: MPI's Allreduce in pieces of ``chunk_bytes``, one
  non-blocking call in flight at a time; runs are summed as soon as they are
  submitted (the overlap with backward), completed in ``complete``.
- ``node_memory.SharedBuckets``: the node's ranks sum their buckets in memory
  they all map (each rank its slice), then across nodes through MPI; every
  arena at once, in ``complete``.
- ``cross_memory.CrossMemory``: the same slices, read out of and written into
  the peers' own memory (process_vm_readv/writev): no shared segment.

Imports run one way: the engine imports backends, backends import _comm.
"""

from typing import Any, Optional, Protocol, Sequence

import numpy as np

__all__ = ["SumBackend", "Summation"]


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

    def complete(self, settle: Any) -> None:
        """Finish every submitted run and settle (mean, finite check) each
        summed bucket through ``settle`` (an engine Settle)."""


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

    def start(self) -> Summation:
        """Begin one call's sum."""

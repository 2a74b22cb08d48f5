"""REDUCE_SCATTER through MPI: every rank's sends, taken end to end as one
buffer in their message dtype, reduced by one ``Reduce_scatter`` (each rank
sends and receives (p-1)/p of it once), this rank's share settled (the
mean, the postscale) into its output. (A large floating-point sum or mean
in equal shares takes the engine's node-memory or cross-memory scatter
instead: the route table, mpigrad._collective.group.)"""

from typing import Any, Optional, Tuple

import numpy as np

from .._comm.checked import Pending
from .._comm.communicator import Communicator
from .._base.dtypes import message_dtype
from .ops import mpi_op
from .reduction import messages, settled
from .spec import Carriage, Collective

__all__ = ["check", "extra", "carriage", "start", "shares"]


def shares(spec: Collective, size: int) -> Tuple[int, ...]:
    """Each rank's elements of ``spec``'s result: its ``counts``, else equal
    parts of the sends (ValueError where they do not divide evenly)."""
    total = sum(a.size for a in spec.sends)
    if spec.counts:
        return spec.counts
    if total % size:
        raise ValueError(f"{spec.name}: expecting the input's {total} elements to divide "
                         f"into {size} equal shares (one per rank)")
    return (total // size,) * size


def check(spec: Collective, comm: Communicator) -> None:
    """One message dtype; shares that cover the input; this rank's output its share."""
    dtypes = {message_dtype(a.dtype, spec.op) for a in spec.sends}
    if not dtypes:
        raise ValueError(f"{spec.name}: expecting at least one input")
    if len(dtypes) > 1:
        raise TypeError(f"{spec.name}: expecting inputs of one dtype, got "
                        f"{sorted(str(a.dtype) for a in spec.sends)}")
    counts = shares(spec, comm.size)
    total = sum(a.size for a in spec.sends)
    if len(counts) != comm.size or sum(counts) != total or min(counts, default=0) < 0:
        raise ValueError(f"{spec.name}: expecting {comm.size} shares covering the input's "
                         f"{total} elements, got {list(counts)}")
    if len(spec.recvs) != 1 or spec.recvs[0].size != counts[comm.rank]:
        got = [a.size for a in spec.recvs]
        raise ValueError(f"{spec.name}: expecting one output of this rank's "
                         f"{counts[comm.rank]} elements, got outputs of {got}")


def extra(spec: Collective) -> int:
    """Nothing rides on the agreement."""
    return 0


def carriage(spec: Collective, comm: Communicator, capacity: int) -> Optional[Carriage]:
    """Nothing is carried in the agreement: the data moves after it."""
    return None


def start(spec: Collective, comm: Communicator, extra: int) -> Pending:
    """Start the reduce-scatter of ``spec`` (agreed); its Pending settles this
    rank's share into its output."""
    ((wire, _, flat),) = messages(spec, as_is=True)
    counts = shares(spec, comm.size)
    out = spec.recvs[0].reshape(-1)
    share = out if out.dtype == wire else np.empty(out.size, wire)
    started = [comm.start_reduce_scatter(flat, share, counts, f"reduce-scatter of {spec.name}",
                                         mpi_op(spec.op))]

    def finish() -> Any:
        settled(share, [out], spec, comm.size)
        return None
    return Pending(comm, started, finish)

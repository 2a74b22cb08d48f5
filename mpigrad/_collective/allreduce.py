"""ALLREDUCE and REDUCE through MPI: one message per message dtype
(reduction.messages), each one non-blocking MPI operation started through
the watch; the results settled (the mean, the postscale) and written out.
(A floating-point sum or mean of a group's engine size takes the engine's
path instead: the route table, mpigrad._collective.group.)"""

from typing import Any, List

import numpy as np

from .._backends.flight import Sums
from .._comm.checked import Pending
from .._comm.communicator import Communicator, Started
from .._engine.buffers import check_no_aliasing
from .ops import mpi_op
from .reduction import messages, settled
from .spec import Collective, Kind

__all__ = ["check", "extra", "start"]



def check(spec: Collective, comm: Communicator) -> None:
    """In place, no two arrays may share memory (each would get the other's sum)."""
    if not spec.recvs:
        check_no_aliasing(spec.sends, range(len(spec.sends)), f"{spec.noun}s")


def extra(spec: Collective) -> int:
    """Nothing rides on the agreement."""
    return 0


def start(spec: Collective, comm: Communicator, extra: int) -> Pending:
    """Start the reduction of ``spec`` (agreed); its Pending settles and writes
    the results."""
    what = f"{spec.kind.value} of {spec.name}"
    outputs = spec.outputs
    packed = messages(spec, as_is=outputs is spec.sends)
    op = mpi_op(spec.op)
    started: List[Started] = []
    for wire, _, flat in packed:
        if spec.kind == Kind.ALLREDUCE and spec.wire is not None and op == "sum" \
                and wire == np.float32:
            _sum_on_wire(comm, flat, spec.wire, what)        # blocking: its pieces in flight
        elif spec.kind == Kind.ALLREDUCE:
            started.append(comm.start_allreduce(flat, op, what))
        else:
            assert spec.root is not None
            started.append(comm.start_reduce(flat, op, spec.root, what))
    mine = spec.kind == Kind.ALLREDUCE or comm.rank == spec.root

    def finish() -> Any:
        if mine:
            for _, members, flat in packed:
                settled(flat, [outputs[i] for i in members], spec, comm.size)
        return None
    return Pending(comm, started, finish)


def _sum_on_wire(comm: Communicator, flat: np.ndarray, wire: str, what: str) -> None:
    """Sum the 1-D float32 ``flat`` in place through ``wire`` ("bfloat16" or
    "float16": mpigrad._backends.wire), in pieces of the chunk size, watched."""
    sums = Sums(comm, wire)
    for lo, hi in sums.cuts(flat):
        sums.add(flat[lo:hi], what)
    sums.progress()
    sums.finish()

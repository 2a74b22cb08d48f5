"""ALLREDUCE and REDUCE through MPI: one message per message dtype
(reduction.messages), each one non-blocking MPI operation started through
the watch; the results settled (the mean, the postscale) and written out.
A small call's messages ride on its agreement instead (``carriage``): every
rank gets every rank's, and each reduces them itself, in rank order (the
same bits on every rank), with no message more. (A floating-point sum or
mean of a group's engine size takes the engine's path instead: the route
table, mpigrad._collective.group.)"""

import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .._backends.flight import Sums
from .._comm.checked import Carrying, Pending
from .._comm.communicator import Communicator, Started
from .._base.dtypes import message_dtype
from .._base.array_lists import add_rows
from .._engine.buffers import check_no_aliasing
from .._engine.settle import settle
from .ops import mpi_op
from .reduction import Layout, Message, factor_of, layout, messages, settled
from .spec import Collective, Kind

__all__ = ["check", "extra", "carriage", "start", "SmallReduction"]

#: the op table's MPI ops, reduced locally (a carried call's): two addends into the first
_LOCAL: Dict[str, Callable[..., Any]] = {
    "sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def check(spec: Collective, comm: Communicator) -> None:
    """In place, no two arrays may share memory (each would get the other's sum);
    into new arrays (``fresh``) the sends are only read."""
    if not spec.recvs and not spec.fresh and len(spec.sends) > 1 and \
            all(isinstance(a, np.ndarray) for a in spec.sends):
        check_no_aliasing(spec.sends, range(len(spec.sends)), f"{spec.noun}s")


def extra(spec: Collective) -> int:
    """Nothing rides on the agreement."""
    return 0


class SmallReduction:
    """A small reduction's Carriage (one signature's): its messages' layout,
    their bytes end to end (each a multiple of 8 bytes long), its local op,
    whether any message is floating point (its overflows and nan propagate,
    as through MPI, unreported), and which messages are their output already
    once reduced (in place, one array of the message dtype, not scaled)."""

    def __init__(self, spec: Collective, size: int, nbytes: int) -> None:
        self.known = layout(spec)
        self.nbytes = nbytes
        self.reduce = _LOCAL[mpi_op(spec.op)]
        self.floating = any(wire.kind in "fc" for wire, _ in self.known)
        self.sums = self.floating and self.reduce is np.add
        plain = not spec.recvs and spec.op != "mean" and spec.prescale == spec.postscale == 1.0
        self.settles = [not (plain and len(members) == 1 and spec.sends[members[0]].dtype == wire)
                        for wire, members in self.known]
        # each message's place in the agreement's bytes: (offset, bytes), and its views
        # there, made for the last memory seen (the agreement's own: the same every call)
        sizes = [sum(spec.sends[i].size for i in members) * wire.itemsize
                 for wire, members in self.known]
        self.places = [(sum(-(-n // 8) * 8 for n in sizes[:k]), sizes[k])
                       for k in range(len(sizes))]
        self.written: Tuple[Optional[np.ndarray], List[np.ndarray]] = (None, [])
        self.read: Tuple[Optional[np.ndarray], List[List[np.ndarray]]] = (None, [])
        # one array in place, its own message (``run``), and its factor, made once here
        self.direct = _direct(spec, self.known)
        self.factor = factor_of(spec, self.known[0][0], size) if self.direct else None

    def carry(self, spec: Collective, comm: Communicator,
              into: np.ndarray) -> Callable[[np.ndarray], Pending]:
        """This call's messages written into ``into``; what reduces every
        rank's into its outputs."""
        packed = messages(spec, as_is=not spec.recvs, known=self.known)
        if self.written[0] is not into:
            self.written = self.views_into(into)
        for (_, _, flat), place in zip(packed, self.written[1]):
            place[...] = flat
        return lambda gathered: self.reduced_here(spec, comm, packed, gathered)

    def reduced_here(self, spec: Collective, comm: Communicator, packed: List[Message],
                     gathered: np.ndarray) -> Pending:
        """Every rank's messages (``gathered``: ranks x bytes) reduced on this
        rank in rank order into its own, then settled and written out (on
        every rank for ALLREDUCE, on the root for REDUCE)."""
        if spec.kind == Kind.REDUCE and comm.rank != spec.root:
            return _done(comm)
        outputs = spec.outputs
        if self.read[0] is not gathered:
            self.read = self.rows_of(gathered)
        for (wire, members, flat), settles, rows in zip(packed, self.settles, self.read[1]):
            self.reduce_rows(rows, flat)
            if settles:
                settled(flat, [outputs[i] for i in members], spec, comm.size)
        return _done(comm)

    def run(self, spec: Collective, sends: Tuple[np.ndarray, ...], comm: Communicator,
            carrying: Carrying) -> Optional[int]:
        """The whole of a ``direct`` call like ``spec`` on ``sends`` (one array):
        the array written into the agreement, which ``carrying`` makes; where
        every rank carried its own, every rank's summed (in rank order) into
        the array, scaled (the mean, the postscale), and None; else the
        ``extra`` agreed (the caller starts the data as ``start`` does)."""
        send = sends[0]
        flat = send if send.ndim == 1 else send.reshape(-1)
        written = self.written
        if written[0] is not carrying.data:
            written = self.written = self.views_into(carrying.data)
        written[1][0][...] = flat
        gathered, extra = carrying.agree()
        if gathered is None:
            return extra
        if spec.kind == Kind.REDUCE and comm.rank != spec.root:
            return None
        read = self.read
        if read[0] is not gathered:
            read = self.read = self.rows_of(gathered)
        self.reduce_rows(read[1][0], flat)
        if self.factor is not None:
            settle(flat, self.factor)
        return None

    def views_into(self, into: np.ndarray) -> Tuple[np.ndarray, List[np.ndarray]]:
        """Each message's place in the agreement's bytes ``into``, as its dtype."""
        return into, [into[at:at + n].view(wire)
                      for (wire, _), (at, n) in zip(self.known, self.places)]

    def rows_of(self, gathered: np.ndarray) -> Tuple[np.ndarray, List[List[np.ndarray]]]:
        """Each message's rows (one per rank) in every rank's ``gathered`` bytes."""
        return gathered, [list(gathered[:, at:at + n].view(wire))
                          for (wire, _), (at, n) in zip(self.known, self.places)]

    def reduce_rows(self, rows: List[np.ndarray], flat: np.ndarray) -> None:
        """``flat`` = the op of ``rows`` in their order: a floating-point sum in one C
        call where it is built (add_rows), else through numpy."""
        if self.sums and add_rows(rows, flat):
            return
        reduce = self.reduce
        if len(rows) == 1:
            flat[...] = rows[0]
            return
        with np.errstate(all="ignore") if self.floating else _NO_STATE:
            reduce(rows[0], rows[1], out=flat)
            for row in rows[2:]:
                reduce(flat, row, out=flat)


def carriage(spec: Collective, comm: Communicator, capacity: int) -> Optional[SmallReduction]:
    """How calls like ``spec`` ride on their agreement, where their messages
    fit ``capacity`` bytes; a wire's sum (its own two collectives) never does."""
    size = sum(-(-a.size * message_size(a.dtype, spec.op) // 8) * 8 for a in spec.sends)
    if size > capacity or (spec.wire is not None and spec.kind == Kind.ALLREDUCE):
        return None
    return SmallReduction(spec, comm.size, size)


#: the numpy error state kept as it is (integer messages: nothing to silence)
_NO_STATE = contextlib.nullcontext()


def _done(comm: Communicator) -> Pending:
    """A call finished already, as a Pending."""
    return Pending(comm, [], _nothing)


def _nothing() -> None:
    return None


def _direct(spec: Collective, known: Layout) -> bool:
    """Whether calls like ``spec`` are one array in place (not into new arrays)
    that is its own message (its dtype the message dtype, not prescaled), which a
    scale at most settles (floating point, or neither a mean nor a postscale):
    summed back into itself."""
    if len(known) != 1 or len(known[0][1]) != 1 or spec.recvs or spec.fresh or \
            spec.prescale != 1.0:
        return False
    wire = known[0][0]
    return bool(spec.sends[0].dtype == wire and
                (wire.kind in "fc" or spec.op != "mean" and spec.postscale == 1.0))


def message_size(dtype: np.dtype, op: str) -> int:
    """The bytes of one element of ``dtype`` in its message for ``op``."""
    return int(message_dtype(dtype, op).itemsize)


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

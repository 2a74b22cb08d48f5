"""The one checked collective: describe -> local checks -> agree -> start
through the watch -> pending.

Every call mpigrad makes across ranks, in every face, takes this path:

    with checked(comm) as call:                 # local checks inside the block
        ...                                     # any Exception here is agreed
        call.propose(Description("broadcast", (("root", root),), items))
    started = comm.start("Bcast", args, what)   # the watch's pre-start check, then the start
    return Pending(comm, [started], finish)     # waited on under the watch

Leaving the block makes the one agreement: a single Allgather of every
rank's slot, (failed, h, extra, bits, inline bytes, its data), over the
communicator. A rank whose local checks raised re-raises its error, and
every other rank raises PeerError naming it; where the fingerprints of the
proposals differ, the Descriptions are gathered and StructureMismatchError
names the first difference on every rank. ``extra`` (the largest of any
rank: a payload's size) and ``bits`` (ORed over the ranks: the Reducer's
flags) ride along, and so may a small call's whole data (``Carrying``: at
most ``inline_capacity(size)`` bytes): where every rank carried its data,
``gathered`` holds every rank's, and the call needs no message more. An
``absent`` rank (Horovod's joined ranks) takes part without a proposal of
its own.

With ``check=False`` (``Reducer(check=False)``) errors raise where they
happen, and the fingerprints are compared beside the call's messages instead
(``call.beside``, completed after them).
"""

from types import TracebackType
from typing import Any, Callable, List, Optional, Tuple, Type, TypeVar

import numpy as np
from mpi4py import MPI

from .._base.errors import PeerError, StructureMismatchError
from .communicator import Communicator, Started
from .exchange import HEADER, inline_capacity
from .._base.description import Description, describe_mismatch
from .tally import TALLY

__all__ = ["AGREED_BITS", "Checked", "checked", "Carrying", "Beside", "Pending",
           "inline_capacity"]

#: how many bits of a proposal's ``bits`` are agreed on
AGREED_BITS = 63

_ABSENT = np.iinfo(np.int64).min
_FAILED, _FINGERPRINT, _EXTRA, _BITS, _INLINE = range(HEADER)      # a slot's header words
_NOT_INLINE = -1
_P = TypeVar("_P", bound="Pending")


class Checked:
    """One checked collective's agreement (``checked``): propose inside the
    ``with`` block; after it, ``extra`` and ``bits`` hold what was agreed."""

    def __init__(self, comm: Communicator, check: bool = True) -> None:
        self.comm = comm
        self.check = check
        self.fingerprint = 0
        self.describe: Callable[[], Optional[Description]] = lambda: None
        self.extra = 0               # after the block: the largest of any rank
        self.bits = 0                # after the block: ORed over the ranks
        self.absent = False
        # after the block, where every rank carried its data (Carrying): every
        # rank's, (ranks, bytes)
        self.gathered: Optional[np.ndarray] = None
        self.beside: Optional[Beside] = None   # check=False: the comparison in flight

    def propose(self, description: Optional[Description] = None, *,
                fingerprint: Optional[int] = None,
                describe: Optional[Callable[[], Description]] = None,
                extra: int = 0, bits: int = 0, absent: bool = False) -> None:
        """What this rank is about to do: a ``description``, or its
        ``fingerprint`` with a ``describe`` that builds it (only on a
        mismatch); ``extra`` (an int >= 0) and ``bits`` (AGREED_BITS bits)
        to agree on; ``absent``: take part without a description."""
        if description is not None:
            self.fingerprint, self.describe = description.fingerprint, lambda: description
        elif fingerprint is not None and describe is not None:
            self.fingerprint, self.describe = fingerprint, describe
        self.extra, self.bits, self.absent = extra, bits, absent

    def __enter__(self) -> "Checked":
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], error: Optional[BaseException],
                 trace: Optional[TracebackType]) -> None:
        if error is not None and not isinstance(error, Exception):
            return                   # KeyboardInterrupt, SystemExit: as they are
        if not self.check:           # errors raise as they are
            if error is None:
                self.beside = Beside(self.comm, self.fingerprint)
            return
        self._agree(error)

    def _agree(self, error: Optional[BaseException]) -> None:
        comm = self.comm
        exchange = comm.exchange
        slot, slots = exchange.slot, exchange.slots
        exchange.header_of = None
        slot[_FAILED] = error is not None
        slot[_FINGERPRINT] = _ABSENT if self.absent else self.fingerprint
        slot[_EXTRA], slot[_BITS] = self.extra, self.bits
        slot[_INLINE] = _NOT_INLINE
        TALLY.agreements += 1
        comm.wait(comm.start_agreement("structure check"))
        self.judge(slot, slots, error, _NOT_INLINE)

    def judge(self, slot: np.ndarray, slots: np.ndarray, error: Optional[BaseException],
              carried: int) -> None:
        """What every rank's gathered ``slots`` (this rank's ``slot`` among
        them, its data ``carried`` bytes, -1: none) agree: raise on every
        rank where one failed or proposed something else, else set
        ``extra``, ``bits`` and ``gathered``."""
        comm = self.comm
        header = slot[:HEADER].tobytes()
        if error is None and slots[:, :HEADER].tobytes() == header * comm.size:
            # every rank proposed what this one did (the common case): agreed as it is
            if carried >= 0:
                self.gathered = _carried(slots, carried)
            return
        if slots[:, _FAILED].any():
            report = None if error is None else f"{type(error).__name__}: {error}"
            reports = comm.allgather_reports(report)
            if error is not None:
                comm.raise_agreed(error)
            failed = [r for r, m in enumerate(reports) if m is not None]
            raise PeerError(failed, [m for m in reports if m is not None])
        present = slots[slots[:, _FINGERPRINT] != _ABSENT, _FINGERPRINT]
        if present.size and (present != present[0]).any():
            descriptions = comm.allgather_objects(
                None if self.absent else self.describe(),
                f"descriptions after a mismatch (fingerprints {present.tolist()}, this "
                f"rank's {'absent' if self.absent else self.fingerprint})")
            raise StructureMismatchError(describe_mismatch(descriptions))
        self.extra = int(slots[:, _EXTRA].max())
        self.bits = int(np.bitwise_or.reduce(slots[:, _BITS]))
        if carried >= 0 and (slots[:, _INLINE] == carried).all():
            self.gathered = _carried(slots, carried)


class Carrying:
    """The agreement of a repeated proposal that carries its data (a small
    call of one signature: its fingerprint, its data's size), through the
    communicator's exchange (exchange.py): its header made once and written
    where the slot holds another's, the call's data written straight into
    ``data``, the common case (every rank proposed the same) told by one
    comparison of bytes; any other case judged as ``Checked`` does."""

    __slots__ = ("comm", "exchange", "fingerprint", "describe", "carried", "header", "head",
                 "headers", "data", "gathered", "expected")

    def __init__(self, comm: Communicator, fingerprint: int,
                 describe: Callable[[], Description], carried: int) -> None:
        assert 0 <= carried <= inline_capacity(comm.size)
        self.comm = comm
        self.exchange = exchange = comm.exchange
        self.fingerprint, self.describe, self.carried = fingerprint, describe, carried
        self.header = np.zeros(HEADER, np.int64)
        self.header[_FINGERPRINT], self.header[_INLINE] = fingerprint, carried
        self.head = exchange.slot[:HEADER]
        self.headers = exchange.slots[:, :HEADER]
        self.expected = self.header.tobytes() * comm.size
        #: where this rank writes its data (each piece at a multiple of 8 bytes)
        self.data = exchange.slot[HEADER:].view(np.uint8)
        #: every rank's data once agreed, (ranks, bytes): valid until the next agreement
        self.gathered = _carried(exchange.slots, carried)

    def agree(self) -> Tuple[Optional[np.ndarray], int]:
        """Agree, carrying what ``data`` holds: every rank's data (``gathered``)
        where every rank carried its own (else None), and the ``extra`` agreed."""
        comm, exchange = self.comm, self.exchange
        assert comm.exchange is exchange, "a plan made before a shrink"
        if exchange.header_of is not self:
            self.head[...] = self.header
            exchange.header_of = self
        TALLY.agreements += 1
        comm.wait(comm.start_agreement("structure check"))
        if self.headers.tobytes() == self.expected:
            return self.gathered, 0
        call = Checked(comm)
        call.propose(fingerprint=self.fingerprint, describe=self.describe)
        call.judge(self.exchange.slot, self.exchange.slots, None, self.carried)
        return call.gathered, call.extra


def _carried(slots: np.ndarray, carried: int) -> np.ndarray:
    """Every rank's ``carried`` bytes of data out of the gathered slots, (ranks, bytes)."""
    return slots[:, HEADER:].view(np.uint8)[:, :carried]


def checked(comm: Communicator, check: bool = True) -> Checked:
    """One checked collective over ``comm`` (see the module): use as
    ``with checked(comm) as call: ...; call.propose(...)``."""
    return Checked(comm, check)


class Beside:
    """The fingerprints compared beside a call's messages (``check=False``):
    ``complete()`` raises StructureMismatchError on every rank where they differ."""

    def __init__(self, comm: Communicator, fingerprint: int) -> None:
        self.comm = comm
        self.flags = np.array([fingerprint, -fingerprint], np.int64)
        TALLY.agreements += 1
        self.started = comm.start("Allreduce", (MPI.IN_PLACE, [self.flags, MPI.INT64_T], MPI.MAX),
                                  "structure check beside the data (check=False)")

    def complete(self) -> None:
        """Raise StructureMismatchError on every rank if the fingerprints differ."""
        self.comm.wait(self.started)
        if self.flags[0] != -self.flags[1]:
            raise StructureMismatchError(
                "check=False: the ranks made different calls (gradient structure, call kind "
                "or agreed values differ), so the messages they summed do not match and the "
                "results are meaningless (in place: the gradients hold them); run with "
                "check=True to have the difference named before any data moves")


class Pending:
    """A checked collective in flight: the requests it started (through
    ``Communicator.start``) and ``finish``, which makes its result once they
    are done. Made inside a call of ``comm`` begun with ``completes=False``;
    ``wait`` ends that call."""

    __slots__ = ("comm", "started", "finish", "result", "done")

    def __init__(self, comm: Communicator, started: List[Started],
                 finish: Callable[[], Any]) -> None:
        self.comm = comm
        self.started = started
        self.finish = finish
        self.result: Any = None
        self.done = False

    def then(self: _P, fn: Callable[[Any], Any]) -> _P:
        """Finish with ``fn`` of what the call gives (say, as torch tensors)."""
        finish = self.finish
        self.finish = lambda: fn(finish())
        return self

    def test(self) -> bool:
        """Whether the data has moved (does not finish)."""
        return self.done or all(s.request.Test() for s in self.started)

    def wait(self) -> Any:
        """Complete every request under the watch, then finish (once), as the
        end of the call that started it."""
        if not self.done:
            with self.comm.call(begin=False):
                self.complete()
        return self.result

    def complete(self) -> Any:
        """``wait`` inside the call that started it (a blocking collective)."""
        if not self.done:
            for started in self.started:
                self.comm.wait(started)
            self.result = self.finish()
            self.done = True
        return self.result

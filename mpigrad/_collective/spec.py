"""What a face asks of a group of ranks: one typed collective (``Collective``),
or the local error that kept the face from making one (``Request``)."""

import enum
from typing import Any, Callable, NamedTuple, Optional, Protocol, Tuple, Union

import numpy as np

from .._base.description import Description, Pairs
from .._comm.checked import Carrying, Pending
from .._comm.communicator import Communicator

__all__ = ["Kind", "Collective", "Kept", "Request", "Carriage", "reduces"]


class Kind(enum.Enum):
    """What a Collective does with its arrays (see Collective); one module of
    this package runs each."""

    ALLREDUCE = "allreduce"
    REDUCE = "reduce"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    ALLGATHER = "allgather"
    GATHER = "gather"
    SCATTER = "scatter"
    ALLTOALL = "alltoall"
    BARRIER = "barrier"


def reduces(kind: Kind) -> bool:
    """Whether collectives of ``kind`` reduce with an op."""
    return kind in (Kind.ALLREDUCE, Kind.REDUCE, Kind.REDUCE_SCATTER)


class Collective(NamedTuple):
    """One typed collective, as a face asks for it (a NamedTuple: small calls
    make one each, and pay for every microsecond).

    Args:
        kind: what it does:
            ALLREDUCE: ``recvs[i]`` (default: ``sends[i]``, in place) gets
            ``op`` of every rank's ``sends[i]``; REDUCE: the same on ``root``
            only; REDUCE_SCATTER: ``op`` of every rank's ``sends`` (taken end
            to end as one buffer) of which rank r gets the r-th of ``counts``
            consecutive elements (default: equal parts) in ``recvs[0]``;
            BROADCAST: ``root``'s ``sends`` overwrite every rank's, and root's
            ``payload`` comes back; ALLGATHER: every rank's ``sends[0]`` into
            ``recvs`` in rank order (one array per rank, or one of them all),
            or with a ``payload`` every rank's payload (any sizes), or with
            no ``recvs`` every rank's rows of each of ``sends`` (their
            first dimensions may differ across ranks, the same among one
            rank's sends: a row gather, as of sparse rows; op "mean" averages
            the floating-point ones); GATHER:
            the same into root's ``recvs`` only; SCATTER: root's ``sends``
            (one per rank) into each rank's ``recvs[0]``; ALLTOALL:
            ``sends[r]`` to rank r, ``recvs[r]`` from it; BARRIER: nothing.
        name: the face's call, as the agreement and reports name it.
        sends: this rank's arrays in (host numpy, C-contiguous; or, summed by a
            device-aware MPI, device buffers: mpigrad._collective.device).
        recvs: where results go (host numpy, C-contiguous, writeable).
        op: a reduction's op, a name of the op table (mpigrad._collective.ops;
            "mean": the sum, then the one mean).
        root: the root rank of REDUCE, BROADCAST, GATHER and SCATTER.
        counts: REDUCE_SCATTER: each rank's elements of the result.
        prescale, postscale: a reduction's factors (Horovod's): every
            addend multiplied by ``prescale`` before the op, the result by
            ``postscale`` after it (and the mean); integers rounded toward
            zero, as torch's casts.
        wire: a reduction's float32 messages travel as this half dtype
            ("bfloat16", "float16": mpigrad's wire, summed in float32;
            Horovod's compression), where the op is a sum or a mean.
        items: one line per array, compared across ranks (dtypes and shapes).
        settings: more (name, value) pairs every rank must share.
        structure: the caller's tree structure, compared across ranks.
        payload: BROADCAST: root's bytes; ALLGATHER: this rank's bytes.
        fresh: ALLREDUCE: the results in new arrays, which ``run`` returns
            (``sends`` stay as they are).
        noun: what an item is called in a mismatch report.
    """

    kind: Kind
    name: str
    sends: Tuple[np.ndarray, ...] = ()
    recvs: Tuple[np.ndarray, ...] = ()
    op: str = "sum"
    root: Optional[int] = None
    counts: Tuple[int, ...] = ()
    prescale: float = 1.0
    postscale: float = 1.0
    wire: Optional[str] = None
    items: Tuple[str, ...] = ()
    settings: Pairs = ()
    structure: Optional[str] = None
    payload: Optional[bytes] = None
    fresh: bool = False
    noun: str = "tensor"

    def describe(self) -> Description:
        """What every rank must do alike: the call, its op, root and shares,
        its items."""
        settings = self.settings
        if reduces(self.kind) or self.op != "sum":      # (a row gather's mean)
            settings = (("op", self.op),) + settings
            if (self.prescale, self.postscale) != (1.0, 1.0):
                settings = settings + (("prescale_factor", self.prescale),
                                       ("postscale_factor", self.postscale))
            if self.wire is not None:
                settings = settings + (("wire", self.wire),)
        if self.root is not None:
            settings = settings + (("root", self.root),)
        if self.counts:
            settings = settings + (("counts", self.counts),)
        return Description(self.name, settings, self.items, self.structure, noun=self.noun)

    def replaced(self, **fields: Any) -> "Collective":
        """The same collective with ``fields`` (by name) changed."""
        return self._replace(**fields)

    def with_sends(self, sends: Tuple[np.ndarray, ...]) -> "Collective":
        """The same collective with ``sends`` (``replaced(sends=...)`` at a
        quarter of its cost: a small call's kept translation, every call)."""
        return tuple.__new__(Collective, (self[0], self[1], sends) + self[3:])

    @property
    def outputs(self) -> Tuple[np.ndarray, ...]:
        """A reduction's outputs: ``recvs``, else ``sends`` (in place)."""
        return self.recvs or self.sends


class Kept(NamedTuple):
    """A repeated call as a face keeps its translation: ``template`` (the same
    object every call, its sends empty) and this call's ``sends`` (of the same
    dtypes and sizes every call); ``Group.run`` finds its Plan by the template,
    not by the call's signature (a small call pays for every microsecond)."""

    template: Collective
    sends: Tuple[np.ndarray, ...]

    @property
    def name(self) -> str:
        return self.template.name

    @property
    def recvs(self) -> Tuple[np.ndarray, ...]:
        return self.template.recvs


#: a face's request: a Collective, or the local error that kept it from making one
#: (raised on this rank, PeerError on the others, in the agreement; ``Group.run`` takes a
#: Kept one too)
Request = Union[Collective, Exception]


class Carriage(Protocol):
    """How the small calls of one signature ride on their agreement (made
    once per signature, kept in its Plan): ``nbytes`` of data in all;
    ``carry``: one call's data written into ``into`` (the agreement's own
    bytes: each piece at a multiple of 8), and what finishes the call from
    every rank's (ranks, bytes), as a Pending; where ``direct`` (one array
    that is its own message), ``run``: the whole call, its agreement made by
    ``carrying`` (None; or the ``extra`` agreed where not every rank carried
    its data: the caller starts the data), ``spec``'s sends being ``sends``."""

    @property
    def nbytes(self) -> int: ...

    @property
    def direct(self) -> bool: ...

    def carry(self, spec: Collective, comm: Communicator,
              into: np.ndarray) -> Callable[[np.ndarray], Pending]: ...

    def run(self, spec: Collective, sends: Tuple[np.ndarray, ...], comm: Communicator,
            carrying: Carrying) -> Optional[int]: ...

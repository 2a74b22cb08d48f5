"""The engine behind one Reducer: its communicator, backends, plans and
negotiator, and every call's one path: negotiate into a CallPlan, then run
it (the Pipeline for a reduction, a ScatterCall or the allgather for the
shards). The Reducer (mpigrad.reducer) is the face over it: the public
arguments, their documentation, and the results in the caller's kinds."""

from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Optional, Protocol

import numpy as np
from mpi4py import MPI

from .._backends.select import select
from .._base.errors import MpigradError, RanksLost
from .._base.settings import Settings
from .._base.tree import unflatten
from .._base.validate import agreed
from .._base.arrays import to_host
from .._comm.checked import checked
from .._comm.communicator import Communicator
from .._base.description import Description
from .._comm.ulfm import is_process_failure, ulfm_problem
from .._base.exact_sum import ExactSum
from .cache import PlanCache, Planned
from .exact import ExactCall, ExactScatter
from .negotiate import Flags, Negotiator, leaves_of
from .pipeline import Pipeline
from .plan import FusionPlan
from .scatter import ScatterCall, allgather, check_shards
from .shards import owned

__all__ = ["Engine", "Overlapped"]


class Work(Protocol):
    """A call being executed: a Pipeline or a ScatterCall."""

    @property
    def finite(self) -> Optional[bool]:
        """With check_finite: every value of the call is finite (after finish)."""

    @property
    def summed_by(self) -> str:
        """What sums the call: its backend's name ("mpi", "node memory", ...)."""

    @property
    def measured(self) -> Dict[str, float]:
        """Where the backend was chosen by measurement (choice.Trial): each
        candidate's agreed time in ms; else empty."""

    def mark(self, *indices: int) -> None:
        """Gradients ``indices`` are final (checked; local)."""

    def launch(self) -> None:
        """Launch what became complete."""

    def finish(self) -> Any:
        """Complete the call; its result."""


class Engine:
    """Everything behind one Reducer (construction is collective over ``comm``).

    Args:
        comm: the caller's mpi4py communicator (duplicated).
        settings: the validated settings, or ``error``: why they could not
            be (raised on every rank, as a difference between the ranks'
            settings is).
        communicator: instead of a duplicate of ``comm``, this Communicator
            (a Group's, borrowed: ``free`` leaves it).
    """

    def __init__(self, comm: Optional[MPI.Intracomm], settings: Settings,
                 error: Optional[Exception] = None,
                 communicator: Optional[Communicator] = None) -> None:
        self.settings = settings
        self.owns_comm = communicator is None
        self.comm = communicator or Communicator(comm, settings.chunk_bytes, settings.timeout,
                                                 settings.on_failure)
        # a rank lost while the Reducer is made: the survivors shrink here (as
        # those that completed the construction do in their first call), and
        # this Engine raises the loss's RanksLost or PeerError at its first
        # call, as they do (a borrowed communicator is inside its owner's call)
        self.lost: Optional[MpigradError] = None
        try:
            try:
                with checked(self.comm) as call:
                    if error is not None:
                        raise error
                    problem = ulfm_problem() if settings.on_failure == "shrink" else None
                    if problem is not None:
                        raise ValueError(f"on_failure='shrink': {problem}")
                    call.propose(Description("Reducer()", settings.agreed()))
            except MPI.Exception as exc:
                if not (self.owns_comm and is_process_failure(exc, self.comm.comm)):
                    raise
                self.lost = self.comm.after_loss()
            # after a loss, MPI's backend alone: the node's are set up collectively,
            # while a survivor that completed the construction is in its first call
            self.backends = select(self.comm, settings if self.lost is None else replace(
                settings, shared_memory=False, cross_memory=False))
        except BaseException:
            if self.owns_comm:
                self.comm.free()
            raise
        self.degree = self.comm.size if settings.degree is None else settings.degree
        self.cache = PlanCache(settings)
        self.negotiator = Negotiator(self.comm, settings, self.cache, self.backends)
        self.finite: Optional[bool] = None     # of the last call
        self.backend: Optional[str] = None     # what summed the last call
        self.measured: Dict[str, float] = {}   # how it was chosen (Work.measured)
        self.overlapped: Optional[Overlapped] = None   # a call started, not yet finished

    @contextmanager
    def call(self, completes: bool = True, begin: bool = True) -> Iterator[None]:
        """One call (see Communicator.call); after a shrink, ``degree``
        follows the survivors' size unless it was given. A new call while one
        started is pending would send its messages among that call's: it
        raises here, and the peers' waits raise PeerError."""
        if self.lost is not None and begin:
            lost, self.lost = self.lost, None
            raise lost
        try:
            with self.comm.call(begin=begin, completes=completes):
                if begin and self.overlapped is not None:
                    raise RuntimeError(
                        "a call of this Reducer while the start() before it is still "
                        "pending: its messages would mix with that call's on the peers; "
                        "wait() for the started call first")
                yield
        except RanksLost:
            self.degree = self.settings.degree or self.comm.size
            raise

    def free(self) -> None:
        """Release the bucket memory and the communicator, where it made it
        (idempotent)."""
        self.cache.clear()
        if self.owns_comm:
            self.comm.free()

    # -- plans -------------------------------------------------------------
    def entry(self, tree: Any) -> Planned:
        """The plan cache's entry of ``tree``'s signature (local)."""
        return self.cache.lookup(to_host(leaves_of(tree)[0], inplace=False)[0])

    def plan(self, tree: Any) -> FusionPlan:
        """The FusionPlan of ``tree`` (local)."""
        return self.entry(tree).plan

    def bucket_views(self, like: Any) -> Any:
        """``like`` with its dense gradients of their wire dtype replaced by
        views into the bucket buffers (collective where buckets live in node
        memory)."""
        if self.backends.groups is not None:       # node memory: set up collectively
            with self.call():
                plan = self.negotiator.negotiate(like, Flags.BUCKET_VIEWS, self.divisor())
            entry, leaves, spec = plan.entry, plan.inputs.leaves, plan.inputs.spec
        else:
            leaves, spec = leaves_of(like)
            entry = self.cache.lookup(leaves)
        return unflatten(spec, entry.hand_out_views(leaves))

    # -- calls -------------------------------------------------------------
    def divisor(self, mean: Optional[bool] = None) -> int:
        """The divisor of a call's mean (1: a sum): ``degree`` where ``mean``
        (default: the setting) asks for one."""
        return self.degree if (self.settings.mean if mean is None else mean) else 1

    def reduce(self, tree: Any, inplace: bool, agree: Any, out: Any = None) -> Any:
        """The reduction of ``tree`` (or of an ExactSum's sums), in the
        caller's structure and kinds (into ``out``'s arrays where given)."""
        with self.call():
            return self.reduce_in_call(tree, inplace, agree, out=out)

    def reduce_in_call(self, tree: Any, inplace: bool, agree: Any,
                       mean: Optional[bool] = None, out: Any = None) -> Any:
        """``reduce`` inside a call its caller began (a Group's); ``mean``:
        this call's sum (False) or mean (True), default the setting."""
        kind = Flags.REDUCE_INPLACE if inplace else Flags.REDUCE
        return self.run(self._reduction(kind, tree, agree, self.divisor(mean), out))

    def start(self, tree: Any, agree: Any) -> "Overlapped":
        """An in-place reduction of ``tree`` to overlap with backward."""
        with self.call(completes=False):
            self.overlapped = Overlapped(self, self._reduction(Flags.START, tree, agree,
                                                               self.divisor()))
            return self.overlapped

    def _reduction(self, kind: Flags, tree: Any, agree: Any, divisor: int,
                   out: Any = None) -> Work:
        """The Pipeline of a reduction, or with reproducible=True its ExactCall
        (an ExactSum is reduced only there: its kind is part of the check);
        ``out``: a plain reduce's result arrays, given."""
        if not self.settings.reproducible and not isinstance(tree, ExactSum):
            return Pipeline(self.negotiator.negotiate(tree, kind, divisor, agree, out=out),
                            self.comm, self.settings)
        acc = tree if isinstance(tree, ExactSum) else None
        values = dict(agree or {})
        values["reduced"] = "an ExactSum" if acc is not None else "gradients"

        def exact_only(entry: Planned) -> None:
            if not self.settings.reproducible:
                raise TypeError("reduce: an ExactSum is reduced by a Reducer(reproducible=True), "
                                "whose sum is exact too; this one is not reproducible")
            if acc is not None and kind != Flags.REDUCE:
                raise TypeError("an ExactSum is reduced by reduce(acc) into new arrays, not in "
                                "place (inplace=True) nor started")
        call = self.negotiator.negotiate(tree if acc is None else acc.like, kind, divisor,
                                         values, check=exact_only, out=out)
        return ExactCall(call, self.comm, self.settings, acc, self.backends.exact_node)

    def reduce_scatter(self, tree: Any, agree: Any) -> Dict[np.dtype, np.ndarray]:
        """This rank's shards of the reduction of ``tree``."""
        with self.call():
            return self.reduce_scatter_in_call(tree, agree)

    def reduce_scatter_in_call(self, tree: Any, agree: Any,
                               into: Optional[Dict[np.dtype, np.ndarray]] = None,
                               mean: Optional[bool] = None) -> Dict[np.dtype, np.ndarray]:
        """``reduce_scatter`` inside a call its caller began (a Group's): the
        shards written into ``into`` ({wire dtype: a 1-D array of the
        shard's size}, for the dtypes it holds); ``mean``: this call's sum
        (False) or mean (True), default the setting."""
        shards: Dict[np.dtype, np.ndarray] = self.run(
            self._scatter(Flags.REDUCE_SCATTER, tree, agree, self.divisor(mean), into))
        return shards

    def start_reduce_scatter(self, tree: Any, agree: Any) -> "Overlapped":
        """A reduce-scatter of ``tree`` to overlap with backward."""
        with self.call(completes=False):
            self.overlapped = Overlapped(self, self._scatter(Flags.START_SCATTER, tree, agree,
                                                             self.divisor()))
            return self.overlapped

    def _scatter(self, kind: Flags, tree: Any, agree: Any, divisor: int,
                 into: Optional[Dict[np.dtype, np.ndarray]] = None) -> Work:
        call = self.negotiator.negotiate(tree, kind, divisor, agree, check=_dense_only)
        if self.settings.reproducible:
            return ExactScatter(call, self.comm, self.settings, into=into,
                                node=self.backends.exact_node)
        return ScatterCall(call, self.comm, self.settings.check_finite, self.backends.shards,
                           into)

    def allgather_shards(self, shards: Optional[Dict[Any, np.ndarray]], into: Any) -> Any:
        """Every rank's ``shards`` gathered into the arrays of ``into``."""
        def matching(entry: Planned) -> None:
            check_shards(entry, shards, self.comm.rank, self.comm.size)
        with self.call():
            call = self.negotiator.negotiate(into, Flags.ALLGATHER, self.divisor(), check=matching)
            return allgather(call, shards, self.backends.shards)

    def agree(self, values: Any, error: Optional[BaseException]) -> None:
        """Every rank passed the same ``values``, and no rank an ``error``
        (see Reducer.agree)."""
        with self.call():
            with checked(self.comm) as call:
                if error is not None:
                    raise error
                call.propose(Description("agree()", agreed=agreed("agree", values)))

    def shards(self, tree: Any, rank: int) -> Dict[np.dtype, List[Any]]:
        """Which elements ``rank`` receives of a reduce-scatter of ``tree`` (local)."""
        return owned(self.plan(tree), rank, self.comm.size)

    def run(self, work: Work) -> Any:
        """Finish ``work``; keep its finite flag and backend."""
        self.finite = None
        result = work.finish()
        self.finite = work.finite
        self.backend = work.summed_by
        self.measured = work.measured
        return result


class Overlapped:
    """A call started to overlap with backward (Engine.start,
    Engine.start_reduce_scatter): ``mark`` gradients ready, then ``finish``."""

    def __init__(self, engine: Engine, work: Work) -> None:
        self.engine = engine
        self.work = work

    def mark(self, *indices: int) -> None:
        """Gradients ``indices`` are final: launch what became complete (a part
        of the call: watched, and an error here is the call's)."""
        self.work.mark(*indices)
        with self.engine.call(begin=False, completes=False):
            self.work.launch()

    def finish(self, agree: Any) -> Any:
        """Complete the call the start began; its result. It ends with one
        tiny agreement on ``agree`` (values known only now)."""
        try:
            with self.engine.call(begin=False):
                result = self.engine.run(self.work)
                self.engine.negotiator.confirm(agree)
        finally:
            self.engine.overlapped = None
        return result


def _dense_only(entry: Planned) -> None:
    """A reduce-scatter's own check: no RowSparse gradient."""
    if entry.plan.sparse:
        raise TypeError("reduce_scatter: RowSparse gradients have no element shards; "
                        "reduce them with reduce() (skip them here)")

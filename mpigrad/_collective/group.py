"""The one way in: a group of ranks (``Group``) runs every typed collective a
face asks for (``Group.run``).

``run`` takes the first route of ``ROUTES`` that takes the request: a
face's local error is agreed (raised here, PeerError on the other ranks); a
floating-point sum or mean of the group's engine size (every one on a
Reducer's group, where the Reducer's settings give its bits) is a reduction
of the group's Engine, a large floating-point reduce-scatter in equal
shares the engine's scatter (node memory, cross-memory), whose negotiation
is then the call's one agreement; anything else is agreed (the
Collective's Description: a rank that asks for something else, or whose
local checks failed, raises on every rank before any data moves) and moved
by its kind's module (mpigrad._collective.kinds).

A face never holds a communicator: it holds a Group (made over MPI's world, a
caller's mpi4py communicator, a split of the world by ranks, or a Reducer's
own communicator) and asks it for its rank, size, subgroups and
point-to-point messages.
"""

import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
from mpi4py import MPI

from .._base.description import Description
from .._base.dtypes import assign, wire_dtype
from .._base.settings import Settings, reproducible_setting
from .._comm.checked import Carrying, Checked, Pending, checked, inline_capacity
from .._comm.communicator import Communicator
from .._engine.engine import Engine
from .._engine.settle import settle
from . import messages
from .kinds import PATHS, KindPath
from .messages import Message
from .ops import TABLE, check_op
from .spec import Carriage, Collective, Kept, Kind, Request, reduces

__all__ = ["Group", "Route", "ROUTES", "ENGINE_BYTES"]

#: sums of at least this many bytes go to the engine (node sums pay off from
#: there); smaller ones move through MPI after the agreement
ENGINE_BYTES = 1 << 16

#: the calls' Plans a group keeps (by signature) before it forgets them all
_KEPT_PLANS = 1024


class Group:
    """A group of ranks the faces run typed collectives on.

    Args:
        communicator: its Communicator (made for it: ``Group.over``, or a
            Reducer's or a helper's, which it borrows).
        owned: whether ``free`` frees the communicator.
        point_to_point: whether sends and receives are offered (a split of
            their own, made now: collective).
        calls: what brackets each of its calls (default: the communicator's
            ``call``; a Reducer's group: the Reducer's, which also follows a
            shrink; a MatchingGroup's: nothing, its caller is inside one).
        engine: the Engine its floating-point sums and means go to: a
            Reducer's own (every such sum, whatever its size: the Reducer's
            settings give its bits); default one of the group's, made with
            the default settings at its first sum of ``ENGINE_BYTES`` or more.
    """

    def __init__(self, communicator: Communicator, owned: bool = False,
                 point_to_point: bool = False,
                 calls: Optional[Callable[[], AbstractContextManager[Any]]] = None,
                 engine: Optional[Engine] = None) -> None:
        self.communicator = communicator
        self.owned = owned
        self.calls = calls or communicator.call
        self.engine = engine
        self.owns_engine = engine is None
        self.engine_bytes = ENGINE_BYTES if engine is None else 0
        self.plans: Dict[Any, Plan] = {}     # by a call's signature
        # the plans of the faces' Kept translations (kept_plan), by the template's id:
        # (the template, MPIGRAD_REPRODUCIBLE and the group's size when planned, its Plan)
        self.kept: Dict[int, Tuple[Collective, bool, int, Plan]] = {}
        self.p2p: Optional[MPI.Intracomm] = None
        if point_to_point:
            with communicator.call():
                self.open_point_to_point()

    @classmethod
    def over(cls, comm: Optional[Any] = None, timeout: Optional[float] = None,
             point_to_point: bool = False, on_stall: str = "abort") -> "Group":
        """A Group of its own over ``comm`` (an mpi4py intracommunicator;
        default MPI's world), duplicated (collective); ``on_stall``: see
        Communicator."""
        return cls(Communicator(comm, timeout=timeout, on_stall=on_stall), owned=True,
                   point_to_point=point_to_point)

    @classmethod
    def shared(cls, comm: Optional[Any] = None, timeout: Optional[float] = None) -> "Group":
        """The Group that mpigrad's functions share on ``comm`` (made on the
        first call, collectively; kept with the caller's communicator)."""
        if comm is None and _WORLD and not _WORLD[0].freed:     # (metrics every step)
            _WORLD[0].communicator.timeout = timeout
            return _WORLD[0]
        helper = Communicator.helper(comm, timeout)
        group = _SHARED.get(helper)
        if group is None:
            group = _SHARED[helper] = cls(helper)
        if comm is None:
            _WORLD[:] = [group]
        return group

    @property
    def rank(self) -> int:
        return self.communicator.rank

    @property
    def size(self) -> int:
        return self.communicator.size

    @property
    def freed(self) -> bool:
        return self.communicator.freed

    @property
    def comm(self) -> Any:
        """The group's private mpi4py communicator (for a user who asks)."""
        return self.communicator.comm

    def subgroup(self, ranks: Sequence[int], timeout: Optional[float]) -> "Group":
        """A Group of ``ranks`` of this one (collective over them only: the
        others need not call), with point-to-point messages. MPI's
        Comm_create_group: members that name different ranks stall."""
        return Group.over(self.communicator.create_group(ranks), timeout, point_to_point=True,
                          on_stall=self.communicator.on_stall)

    def split_ranks(self, ranks: Sequence[int], timeout: Optional[float]) -> Optional["Group"]:
        """A Group of ``ranks`` of this one, in that order, with point-to-point
        messages; None on the ranks not in it. Collective over this group:
        every rank names the same ``ranks`` (agreed first: a rank that names
        others raises on every rank), then the members split off (watched)."""
        with self.calls(), checked(self.communicator) as call:
            members = [int(r) for r in ranks]
            if len(set(members)) != len(members) or \
                    not all(0 <= r < self.size for r in members):
                raise ValueError(f"new_group: expecting distinct ranks in [0, {self.size}), "
                                 f"got {list(ranks)}")
            call.propose(Description("new_group", (("ranks", tuple(members)),)))
            member = self.rank in members
            part = self.communicator.split(
                f"new_group({members})", color=0 if member else MPI.UNDEFINED,
                key=members.index(self.rank) if member else 0)
        return Group.over(part, timeout, point_to_point=True,
                          on_stall=self.communicator.on_stall) if member else None

    # -- the one entry -----------------------------------------------------
    def run(self, request: Union[Request, Kept]) -> Any:
        """Run ``request`` (see Collective) as one checked call: the agreement,
        then the data; what the kind gives back (BROADCAST: root's payload;
        ALLGATHER with payloads: every rank's; a ``fresh`` ALLREDUCE: the new
        arrays; else None). A local error given as the request raises here,
        PeerError on the other ranks. A Kept request runs on the Plan kept with
        its template (made at its first call; MPIGRAD_REPRODUCIBLE, which picks
        the route, still read every call)."""
        with self.calls():
            if isinstance(request, Exception):
                self.agree(request)                   # raises it, agreed
                raise request                         # (not reached)
            if isinstance(request, Kept):
                template, sends = request
                plan = self.kept_plan(template, sends)
            else:
                template, sends, plan = request, request.sends, self.plan(request)
            carrying = plan.carrying
            if carrying is not None and carrying[0].direct:
                return _directly(self, plan, template, sends)
            spec = template if template.sends is sends else template.with_sends(sends)
            return plan.route.start(self, spec, plan, False).complete()

    def kept_plan(self, template: Collective, sends: Tuple[np.ndarray, ...]) -> "Plan":
        """The Plan of a Kept call (its ``template``, this call's ``sends``), by
        the template itself: kept while the group keeps its plans (and its size:
        a shrink makes them anew)."""
        reproducible = reproducible_setting(None)
        kept = self.kept.get(id(template))
        if kept is None or kept[0] is not template or kept[1] != reproducible or \
                kept[2] != self.communicator.size:
            if len(self.kept) >= _KEPT_PLANS:
                self.kept.clear()
            kept = self.kept[id(template)] = (template, reproducible, self.communicator.size,
                                              self.plan(template.with_sends(sends)))
        return kept[3]

    def start(self, spec: Collective) -> Pending:
        """Start ``spec`` (``check``ed) without an agreement of its own: for an
        adapter whose calls the ranks have agreed on already (a
        MatchingGroup's matched round), inside its call; its Pending (the
        engine's routes have completed: their negotiation agrees)."""
        plan = self.plan(spec)
        return plan.route.start(self, spec, plan, True)

    def check(self, spec: Collective) -> None:
        """``spec``'s local checks: the op table's op x dtype rules (for a
        reduction), its kind's own."""
        self.plan(spec).path.check(spec, self.communicator)

    def agree(self, request: Request, plan: Optional["Plan"] = None) -> Checked:
        """The call's agreement: ``request``'s local checks and Description
        (its ``plan``'s); what was agreed: ``extra`` (the largest of any
        rank's: root's payload size)."""
        with checked(self.communicator) as call:
            if isinstance(request, Exception):
                raise request
            known = plan or self.plan(request)
            known.path.check(request, self.communicator)
            call.propose(fingerprint=known.fingerprint, describe=lambda: known.description,
                         extra=known.path.extra(request))
        return call

    def plan(self, spec: Collective) -> "Plan":
        """What a call like ``spec`` does: its route (the first of ``ROUTES``
        that takes it), its Description (a float reduction's with
        MPIGRAD_REPRODUCIBLE, which picks its path) and fingerprint, its op
        checked against the op table. Made once per signature of a call
        (small calls pay for every microsecond), kept while the group lives."""
        reproducible = reproducible_setting(None)
        # everything but the arrays and the payload (spec.kind, name; op .. structure;
        # fresh, noun), the arrays' dtypes and sizes
        key = (self.size, reproducible, spec[:2], spec[4:13], spec[14:], len(spec.recvs),
               *[(a.dtype, a.nbytes) for a in spec.sends])
        known = self.plans.get(key)
        if known is None:
            if reduces(spec.kind):
                check_op(spec.op, (a.dtype for a in spec.sends), spec.name, TABLE)
            description = spec.describe()
            if reduces(spec.kind) and any(_floating(a.dtype) for a in spec.sends):
                description = replace(description, settings=description.settings + (
                    ("MPIGRAD_REPRODUCIBLE", int(reproducible)),))
            route = next(r for r in ROUTES if r.takes(self, spec, reproducible))
            path = PATHS[spec.kind]
            carriage = path.carriage(spec, self.communicator, inline_capacity(self.size)) \
                if route.carries else None
            carrying = None if carriage is None else (carriage, Carrying(
                self.communicator, description.fingerprint, lambda: description,
                carriage.nbytes))
            if len(self.plans) >= _KEPT_PLANS:
                self.plans.clear()
                self.kept.clear()
            known = self.plans[key] = Plan(route, path, description, description.fingerprint,
                                           carrying)
        return known

    def takes_engine(self, spec: Collective, reproducible: bool) -> bool:
        """Whether ``spec`` is a sum the engine makes (its agreement the call's):
        floating point, in place, not prescaled nor on a wire of its own, of
        ``engine_bytes`` or more (or any size where sums are exact)."""
        return (spec.kind == Kind.ALLREDUCE and spec.op in ("sum", "mean") and not spec.recvs
                and _plain(spec) and bool(spec.sends)
                and all(_floating(a.dtype) for a in spec.sends)
                and self._large(spec, reproducible))

    def scatters_by_engine(self, spec: Collective, reproducible: bool) -> bool:
        """Whether ``spec`` is a reduce-scatter the engine's scatter makes: a
        floating-point sum or mean of one dtype in equal shares, not
        prescaled nor on a wire of its own, of ``engine_bytes`` or more (or
        any size where sums are exact)."""
        return (spec.kind == Kind.REDUCE_SCATTER and spec.op in ("sum", "mean")
                and _plain(spec) and bool(spec.sends) and len(spec.recvs) == 1
                and len({a.dtype for a in spec.sends}) == 1 and _floating(spec.sends[0].dtype)
                and len(set(spec.counts)) <= 1 and self._large(spec, reproducible))

    def _large(self, spec: Collective, reproducible: bool) -> bool:
        return sum(a.nbytes for a in spec.sends) >= self.engine_bytes or reproducible

    def engine_of(self, spec: Collective) -> Engine:
        """The group's Engine, made on first use (collectively, once ``spec``
        is agreed: every rank asks for the same call) on the group's
        communicator, with the default settings (the mean is the call's)."""
        if self.engine is None:
            self.agree(spec)
            settings = Settings.validated(timeout=self.communicator.timeout,
                                          on_failure=self.communicator.on_failure)
            self.engine = Engine(None, settings, communicator=self.communicator)
        return self.engine

    # -- point-to-point ----------------------------------------------------
    def post(self, name: str, arrays: Sequence[np.ndarray], peer: Optional[int], tag: int,
             what: str) -> Message:
        """Start sending ("Send") ``arrays`` to ``peer``, or receiving ("Recv")
        into them from it (messages.post)."""
        if self.p2p is None:
            raise RuntimeError("this group was made without point-to-point messages")
        return messages.post(self.communicator, self.p2p, name, arrays, peer, tag, what)

    def arrivals(self, seconds: Optional[float], tag: int) -> List[int]:
        """gloo's monitored barrier, as messages (messages.arrivals)."""
        return messages.arrivals(self.communicator, self.open_point_to_point(), seconds, tag)

    def open_point_to_point(self) -> MPI.Intracomm:
        """The split that carries the group's point-to-point messages, made now
        if it is not yet (collective over the group; the watch serves every
        message on the group's own communicator)."""
        if self.p2p is None:
            self.p2p = self.communicator.split("point-to-point messages of the group")
        return self.p2p

    def free(self) -> None:
        """Free the group's engine and its communicator, where it made them."""
        if self.engine is not None and self.owns_engine:
            self.engine.free()
            self.engine = None
        if self.owned:
            self.communicator.free()


#: the Groups of mpigrad's functions, by their shared Communicator
_SHARED: "weakref.WeakKeyDictionary[Communicator, Group]" = weakref.WeakKeyDictionary()
#: the one of MPI's world, once made (found without asking the world for its helper)
_WORLD: List[Group] = []


@dataclass(frozen=True)
class Route:
    """One way a call runs: ``start(group, spec, plan, agreed)`` where
    ``takes(group, spec, reproducible)``; its Pending (``agreed``: the ranks
    agreed on the call already, a MatchingGroup's round); ``carries``: a
    small call's data may ride on its agreement (its kind's ``carriage``)."""

    name: str
    takes: Callable[[Group, Collective, bool], bool]
    start: Callable[[Group, Collective, "Plan", bool], Pending]
    carries: bool = False


class Plan(NamedTuple):
    """What a call of one signature does (``Group.plan``): its route, its
    kind's module (mpigrad._collective.kinds), its Description and the
    fingerprint the ranks agree on; where its data rides on the agreement,
    how (its kind's Carriage) and that agreement, prepared."""

    route: Route
    path: KindPath
    description: Description
    fingerprint: int
    carrying: Optional[Tuple[Carriage, Carrying]]


def _done(group: Group, result: Any) -> Pending:
    """A call that has completed, as a Pending of ``result``."""
    return Pending(group.communicator, [], lambda: result)


def _engine_sum(group: Group, spec: Collective, plan: Plan, agreed: bool) -> Pending:
    """The engine's reduction of the sends (in place, or new arrays: ``fresh``),
    then the postscale."""
    results = group.engine_of(spec).reduce_in_call(
        list(spec.sends), not spec.fresh, {"call": spec.name, "op": spec.op},
        mean=spec.op == "mean")
    if spec.postscale != 1.0:
        for out in results:
            settle(out.reshape(-1), out.dtype.type(spec.postscale))
    return _done(group, results if spec.fresh else None)


def _engine_scatter(group: Group, spec: Collective, plan: Plan, agreed: bool) -> Pending:
    """The engine's reduce-scatter of the sends (end to end) into this rank's
    output (written there directly where it is of the wire dtype and holds
    no input's memory), then the postscale."""
    out = spec.recvs[0].reshape(-1)
    wire = wire_dtype(spec.sends[0].dtype)
    direct = out.dtype == wire and not any(np.shares_memory(out, a) for a in spec.sends)
    shards = group.engine_of(spec).reduce_scatter_in_call(
        list(spec.sends), {"call": spec.name, "op": spec.op},
        into={wire: out} if direct else None, mean=spec.op == "mean")
    shard = shards[wire]
    if spec.postscale != 1.0:
        settle(shard, shard.dtype.type(spec.postscale))
    if not direct:
        assign(out, shard)
    return _done(group, None)


def _fresh(group: Group, spec: Collective, plan: Plan, agreed: bool) -> Pending:
    """An allreduce into new arrays: in place on copies of the sends (the
    same Description: a call into new arrays agrees as one in place)."""
    copies = tuple(np.array(a, order="C") for a in spec.sends)
    pending = _through_mpi(group, spec.replaced(sends=copies, fresh=False), plan, agreed)
    return pending.then(lambda _: list(copies))


def _through_mpi(group: Group, spec: Collective, plan: Plan, agreed: bool) -> Pending:
    """The call's agreement (unless ``agreed``), then its kind's data through
    MPI; a small call's data rides on the agreement itself (its kind's
    ``carried``), and is finished from every rank's there: one message."""
    path, comm = plan.path, group.communicator
    if agreed:
        return path.start(spec, comm, 0)
    if plan.carrying is None:
        return path.start(spec, comm, group.agree(spec, plan).extra)
    carriage, carrying = plan.carrying
    try:
        path.check(spec, comm)
    except Exception as exc:
        group.agree(exc)                      # raises it, agreed
    finish = carriage.carry(spec, comm, carrying.data)
    gathered, extra = carrying.agree()
    if gathered is not None:
        return finish(gathered)
    return path.start(spec, comm, extra)


def _directly(group: Group, plan: Plan, template: Collective,
              sends: Tuple[np.ndarray, ...]) -> None:
    """A small call of one array that is its own message (its Carriage's ``run``:
    nothing to check or pack, nor a Collective to make per call: ``template``
    with this call's ``sends``), run whole; where not every rank carried its
    data, its data started after the agreement, as ``_through_mpi`` does."""
    assert plan.carrying is not None
    carriage, carrying = plan.carrying
    extra = carriage.run(template, sends, group.communicator, carrying)
    if extra is not None:
        plan.path.start(template.with_sends(sends), group.communicator, extra).complete()


def _device_memory(group: Group, spec: Collective, plan: Plan, agreed: bool) -> Pending:
    """Sums of device buffers (mpigrad._collective.device, where MPI is
    device-aware): the agreement, then each buffer summed in place by MPI."""
    comm = group.communicator
    if not agreed:
        group.agree(spec, plan)
    what = f"allreduce of {spec.name} (device memory)"
    return Pending(comm, [comm.start_allreduce(send, "sum", what) for send in spec.sends],
                   lambda: None)


def _in_device_memory(group: Group, spec: Collective, reproducible: bool) -> bool:
    return spec.kind == Kind.ALLREDUCE and spec.op == "sum" and \
        any(not isinstance(a, np.ndarray) for a in spec.sends)


#: the routes, first match wins
ROUTES: Tuple[Route, ...] = (
    Route("device memory through MPI", _in_device_memory, _device_memory),
    Route("the engine's sum", Group.takes_engine, _engine_sum),
    Route("the engine's scatter", Group.scatters_by_engine, _engine_scatter),
    Route("into new arrays", lambda group, spec, reproducible: spec.fresh, _fresh, True),
    Route("through MPI", lambda group, spec, reproducible: True, _through_mpi, True),
)


def _floating(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name == "bfloat16"


def _plain(spec: Collective) -> bool:
    """Not prescaled, not on a wire of its own, postscaled only in the
    precision it is summed in (what the engine cannot do)."""
    return spec.prescale == 1.0 and spec.wire is None and (
        spec.postscale == 1.0 or all(a.dtype in _OWN_PRECISION for a in spec.sends))


#: the dtypes the engine sums in their own precision (a postscale is exact to redo after)
_OWN_PRECISION = (np.dtype(np.float32), np.dtype(np.float64))

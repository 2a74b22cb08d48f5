"""Horovod's matching of collectives by name, on mpigrad's checked path.

Horovod matches the collectives the ranks post by name (its background
thread negotiates which tensors every rank has posted), so ranks may post
them in different orders. Here each process set keeps a queue of posted
collectives (``Table``), and a *round*, collective over the set, matches
them: every rank then starts the matched ones in the same order. A round
runs at every post, and while a rank waits for a collective of its own that
has not started (``synchronize``, ``poll``, a blocking call, ``join``).

A round is one Allreduce(MAX) of a few integers (the set's MatchingGroup's
``compare``: the call's agreement), the first a fingerprint of
the rank's queue (each collective's key and Description). Where the
fingerprints agree (every SPMD script: the same collectives, posted in the
same order) every queued collective starts at once. Otherwise the queues are
gathered and every rank makes the same plan: the collectives posted on every
rank not in ``join()``, in the lowest such rank's order, each checked as
mpigrad checks a call: a local error raises where it happened and PeerError
on the others, a Description that differs StructureMismatchError on every
rank, each when its handle is waited on. When nothing matches and no rank is
posting, nothing ever will: every rank raises StructureMismatchError naming
what each rank waits for and which ranks have not posted it.

A named collective matches by its key, (kind, name). Unnamed ones match in
program order: the i-th unnamed collective not yet started on one rank with
the i-th on every other (key ("", "noname.<i>") in a round).
"""

import itertools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from .._base.description import Description, describe_mismatch, fingerprint
from .._base.errors import PeerError, RanksLost, StructureMismatchError
from .._collective.matched import MatchingGroup, Pending, Started
from . import timeline

__all__ = ["Key", "Finish", "Post", "Posted", "Table", "JOIN_ROUNDS"]

Key = Tuple[str, str]
_P = TypeVar("_P", bound="Posted")
Finish = Callable[[], Any]
#: starts a matched collective: (the set's group, whether some rank is in
#: join()) -> (what it started, what finishes it)
Post = Callable[[MatchingGroup, bool], Tuple[List[Started], Finish]]
#: a joined rank's part in a matched collective (its Description)
TakePart = Callable[[MatchingGroup, Description], None]

#: more rounds than any join() takes: the agreed join key, (this bound -
#: rounds) * size + rank, is largest on the rank that joined last
JOIN_ROUNDS = 1 << 40

# the round's flags, reduced by MAX
_HASH, _MINUS_HASH, _POSTING, _JOINED, _NOT_ALL_JOINED, _ERRORS, _JOIN_KEY = range(7)


def _label(key: Key, description: Optional[Description]) -> str:
    kind, name = key
    if kind:
        return f"{kind} {name!r}"
    what = "collective" if description is None else description.kind
    return f"an unnamed {what} (number {name[len('noname.'):]} of those not started)"


class Posted:
    """A posted collective (Horovod's handle): matched in a round, then
    started; ``wait`` finishes it (running rounds until it is matched).

    Args:
        table: the queue of its process set.
        key: its (kind, name); unnamed: ("", "noname.<n>"), the n-th posted
            on this rank (named so in the timeline; matched by position).
        description: what every rank must post alike under the key.
        error: a local error of its checks (raised where it was posted; the
            other ranks raise PeerError for it).
        post: starts it once matched.
    """

    def __init__(self, table: "Table", key: Key, description: Optional[Description],
                 error: Optional[Exception], post: Post) -> None:
        self.table = table
        self.key = key
        self.description = description
        self.fingerprint = 0 if description is None else description.fingerprint
        self.error = error
        self.post = post
        self.pending: Optional[Pending] = None        # once started
        self.failure: Optional[BaseException] = None  # once matched, where it failed
        self.thens: List[Callable[[Any], Any]] = []
        self.done = False
        self.result: Any = None

    @property
    def matched(self) -> bool:
        return self.pending is not None or self.failure is not None

    def then(self: _P, fn: Callable[[Any], Any]) -> _P:
        """Finish with ``fn`` of what the collective gives."""
        self.thens.append(fn)
        return self

    def test(self) -> bool:
        """Whether it has completed: one round first where it is not matched
        (which waits for the set's ranks to come to a collective call)."""
        if not self.matched:
            self.table.advance(waiting=self)
        if self.failure is not None or self.done:
            return True
        return self.pending is not None and self.pending.test()

    def wait(self) -> Any:
        """Run rounds until it is matched, then complete it (once); raise its
        failure where it failed."""
        if not self.done:
            while not self.matched:
                self.table.advance(waiting=self)
            self.table.landed(self)
            if self.failure is not None:
                raise self.failure
            assert self.pending is not None
            with timeline.span(self.key, self.description):
                result = self.pending.wait()
            for fn in self.thens:
                result = fn(result)
            self.result, self.done = result, True
        return self.result


class Table:
    """The collectives posted on one process set (its group ``group``) and the
    rounds that match them; ``take_part`` is a joined rank's part in a matched
    collective."""

    def __init__(self, group: MatchingGroup, take_part: TakePart) -> None:
        self.group = group
        self.take_part = take_part
        self.queue: List[Posted] = []              # posted, not yet matched
        self.in_flight: Dict[Key, Posted] = {}     # posted with a name, not yet waited on
        self.unnamed = itertools.count()
        self.join_rounds = 0                       # rounds in join(); 0: not joined

    def key(self, kind: str, name: Optional[str]) -> Key:
        """The key of the next collective of ``kind`` named ``name``."""
        return (kind, name) if name is not None else ("", f"noname.{next(self.unnamed)}")

    def matching_keys(self) -> List[Key]:
        """The keys the queue is matched by: named collectives' own, the
        unnamed numbered by their place among the unnamed in the queue."""
        unnamed = itertools.count()
        return [p.key if p.key[0] else ("", f"noname.{next(unnamed)}") for p in self.queue]

    def post(self, posted: Posted) -> Posted:
        """Queue ``posted`` and run a round; raise its local error (after the
        round: its peers learn of it when they post it) or ValueError for a
        name already in flight (locally: nothing is queued)."""
        kind, name = posted.key
        if kind and posted.key in self.in_flight:
            raise ValueError(f"an {kind} named {name!r} is already in flight; synchronize "
                             "it first or use another name")
        self.queue.append(posted)
        if kind and posted.error is None:
            self.in_flight[posted.key] = posted
        timeline.posted(posted.key, posted.description)
        self.advance(posting=posted)
        if posted.error is not None:
            raise posted.error
        return posted

    def landed(self, posted: Posted) -> None:
        """``posted`` was waited on: its name is free again."""
        if self.in_flight.get(posted.key) is posted:
            del self.in_flight[posted.key]

    def join(self) -> int:
        """This rank has no more data: run rounds, taking part in the
        others' allreduces, until every rank of the set has joined; returns
        the rank that joined last."""
        self.join_rounds = 0
        try:
            while True:
                self.join_rounds += 1
                last = self.advance()
                if last is not None:
                    return last
        finally:
            self.join_rounds = 0

    # -- rounds ------------------------------------------------------------------
    def advance(self, waiting: Optional[Posted] = None,
                posting: Optional[Posted] = None) -> Optional[int]:
        """One round (collective over the set): match and start what every
        rank has posted. ``waiting``: the collective this rank waits for
        (None: it is ``posting`` one, or in join). Returns the rank that
        joined last once every rank is in join(), else None."""
        group, joined = self.group, self.join_rounds > 0
        keys = self.matching_keys()
        waits_for = None if waiting is None else keys[self.queue.index(waiting)]
        doing = (f" (this rank waits for {_label(waits_for, waiting.description)})"
                 if waiting is not None and waits_for is not None else
                 f" (this rank posts {_label(keys[-1], posting.description)})"
                 if posting is not None else "")
        what = "the round that matches posted collectives" + doing
        h = fingerprint(tuple((key, p.fingerprint) for key, p in zip(keys, self.queue)))
        flags = np.array([h, -h, waiting is None and not joined, joined, not joined,
                          any(p.error is not None for p in self.queue),
                          (JOIN_ROUNDS - self.join_rounds) * group.size + group.rank if joined
                          else 0], np.int64)
        with group.call():
            timeline.cycle()
            group.compare(flags, what)
            if not flags[_NOT_ALL_JOINED]:
                return int(flags[_JOIN_KEY]) % group.size
            if flags[_HASH] == -flags[_MINUS_HASH] and not flags[_JOINED] \
                    and not flags[_ERRORS]:
                ready, self.queue = self.queue, []
                for posted in ready:
                    self._start(posted, False)
                return None
            self._negotiate(keys, waits_for, bool(flags[_POSTING]), bool(flags[_JOINED]))
        return None

    def _negotiate(self, keys: List[Key], waits_for: Optional[Key], posting: bool,
                   any_joined: bool) -> None:
        """The slow path of a round: every rank's queue, and the same plan on each."""
        group, joined = self.group, self.join_rounds > 0
        mine = [(key, p.description, None if p.error is None else
                 f"{type(p.error).__name__}: {p.error}") for key, p in zip(keys, self.queue)]
        everyone = group.allgather_objects((mine, joined, waits_for), "the posted collectives")
        takers = [r for r, (_, gone, _) in enumerate(everyone) if not gone]
        posted = [{key: (d, e) for key, d, e in queue} for queue, _, _ in everyone]
        ready = [key for key, _, _ in everyone[takers[0]][0]
                 if all(key in posted[r] for r in takers)]
        if not ready:
            if not posting:
                self._stall(everyone, takers, posted)
            return
        queued = dict(zip(keys, self.queue))
        for key in ready:
            failed = [r for r in takers if posted[r][key][1] is not None]
            descriptions = [posted[r][key][0] if r in takers else None
                            for r in range(group.size)]
            failure: Optional[BaseException] = None
            if failed:
                failure = PeerError(failed, [posted[r][key][1] for r in failed])
            elif any(descriptions[r] != descriptions[takers[0]] for r in takers):
                failure = StructureMismatchError(describe_mismatch(descriptions))
            if joined:
                agreed = descriptions[takers[0]]
                if failure is None and agreed is not None:
                    self.take_part(group, agreed)
                continue
            mine_posted = queued.pop(key)
            if mine_posted.error is not None:
                mine_posted.failure = mine_posted.error     # raised where it was posted
            elif failure is not None:
                mine_posted.failure = failure
            else:
                self._start(mine_posted, any_joined)
        if not joined:
            left = set(map(id, queued.values()))
            self.queue = [p for p in self.queue if id(p) in left]

    def _start(self, posted: Posted, any_joined: bool) -> None:
        """Start a matched collective; an error every rank raises at this
        point (a refused join, a check inside a blocking collective) is its
        failure. Any other error leaves the round: the call is abandoned
        (Communicator.call), and the peers raise."""
        timeline.matched(posted.key, posted.description)
        try:
            started, finish = posted.post(self.group, any_joined)
        except RanksLost:
            raise
        except Exception as exc:
            if not self.group.shares(exc):
                raise
            posted.failure = exc
            return
        posted.pending = self.group.pending(started, finish)

    def _stall(self, everyone: Sequence[Any], takers: List[int],
               posted: List[Dict[Key, Any]]) -> None:
        """Nothing matches and every rank waits: raise on every rank what
        each waits for and who has not posted it; the queued collectives fail alike."""
        lines = []
        for rank in takers:
            key = everyone[rank][2]
            if key is not None:
                missing = [r for r in takers if key not in posted[r]]
                lines.append(f"rank {rank} waits for {_label(key, posted[rank][key][0])}, "
                             f"not posted on rank(s) "
                             f"{missing}")
        error = StructureMismatchError(
            "no collective can start: every rank waits for one that another rank has not "
            "posted (" + "; ".join(lines) + "); post the same collectives (and names) on "
            "every rank of the process set")
        for p in self.queue:
            p.failure = error
        self.queue = []
        self.group.raise_agreed(error)

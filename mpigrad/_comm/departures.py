"""How the ranks of a communicator learn that their programs ended: along a
binomial tree, in O(log p) notices per rank rather than one to every peer.

A rank's tree neighbours are its parent (its rank with the lowest set bit
cleared) and its children (its rank plus each power of two below its lowest
set bit); the subtree of rank r holds ranks [r, r + lowbit(r)). A notice
carries every departure its sender knows that the receiver is not known to
know (``Spread`` keeps, per neighbour, what was sent to it or heard from it).

At exit every rank with the communicator runs two phases (``Channel.exit_step``):
up, once its subtree's departures are known (or no notice came for a moment:
a child whose program goes on sends none), one notice to its parent; down,
once every departure is known (or a quiet moment), a notice marked final to
each neighbour whose own final notice has not come, with the departures it
lacks (if any): the sender is about to end, and nothing is sent to it
afterwards (it waits for its neighbours' final notices, or a quiet moment,
before MPI_Finalize). At exit a rank whose program ends too is reached only
where it is a neighbour (beyond, it may have ended already), and the peers
not heard of at all by the end of the phases (programs that go on: they pass
nothing on until they call) are told directly (the watch's ``Channel.tell_ended``).
When every rank exits, each sends one notice up and one to each child (the
parent's final notice comes before the child's down phase): fewer than 2 per
rank on average (1.88 at 16 ranks), log2 p + 2 at most.

A rank whose program goes on floods what it hears: every new departure to
each neighbour that lacks it, routed around ranks known to be ending (their
neighbours are reached through them). A rank waiting in a collective that
cannot complete learns of at least the nearest departure within a few quiet
moments, and raises naming it.
"""

from collections import defaultdict
from typing import AbstractSet, Dict, Iterable, List, Optional, Set, Tuple

__all__ = ["Departure", "Spread", "parent", "children", "subtree", "reach", "pack", "unpack"]

#: why a rank left, how many calls it completed, whether its program is ending
Departure = Tuple[str, int, bool]


def parent(rank: int) -> Optional[int]:
    """``rank``'s parent in the tree (None for rank 0, the root)."""
    return rank & (rank - 1) if rank else None


def children(rank: int, size: int) -> List[int]:
    """``rank``'s children in the tree of ``size`` ranks."""
    low = rank & -rank if rank else 1 << max(size - 1, 0).bit_length()
    out, step = [], 1
    while step < low and rank + step < size:
        out.append(rank + step)
        step <<= 1
    return out


def subtree(rank: int, size: int) -> range:
    """The ranks below ``rank`` in the tree of ``size`` ranks."""
    low = rank & -rank if rank else size
    return range(rank + 1, min(rank + low, size))


def _neighbours(rank: int, size: int) -> List[int]:
    up = parent(rank)
    return children(rank, size) + ([] if up is None else [up])


def reach(rank: int, size: int, skip: AbstractSet[int], drop: AbstractSet[int] = frozenset()
          ) -> List[int]:
    """The ranks ``rank`` sends to: its tree neighbours, each rank in ``skip``
    replaced by that rank's own neighbours (recursively), those in ``drop``
    left out."""
    out: List[int] = []
    seen, stack = {rank} | set(drop), [rank]
    while stack:
        for neighbour in _neighbours(stack.pop(), size):
            if neighbour in seen:
                continue
            seen.add(neighbour)
            (stack if neighbour in skip else out).append(neighbour)
    return out


def pack(departures: Dict[int, Departure]) -> Dict[str, List[Tuple[int, int, bool]]]:
    """``departures`` grouped by reason (at exit most ranks share one): the
    notice's payload."""
    grouped: Dict[str, List[Tuple[int, int, bool]]] = defaultdict(list)
    for rank, (why, calls, exiting) in departures.items():
        grouped[why].append((rank, calls, exiting))
    return dict(grouped)


def unpack(payload: object) -> Optional[Dict[int, Departure]]:
    """The departures of a notice's payload; None if it is not one."""
    if not isinstance(payload, dict):
        return None
    return {rank: (why, calls, exiting)
            for why, entries in payload.items() for rank, calls, exiting in entries}


class Spread:
    """What each tree neighbour of ``rank`` is known to know of the departures,
    and which neighbours sent their final notice (ended, or about to)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.told: Dict[int, Set[int]] = defaultdict(set)
        self.final: Set[int] = set()

    def heard(self, source: int, ranks: Iterable[int], final: bool) -> None:
        """``source`` sent the departures of ``ranks``."""
        self.told[source].update(ranks)
        if final:
            self.final.add(source)

    def notices(self, known: Dict[int, Departure], to: Iterable[int], final: bool = False
                ) -> List[Tuple[int, Dict[int, Departure]]]:
        """(neighbour, the departures it lacks) for each of ``to`` that lacks
        any, recorded as told; ``final``: for each of ``to`` that has not sent
        its final notice, lacking nothing too (it must not send to this rank
        once it has ended)."""
        out = []
        for neighbour in to:
            if neighbour in self.final:
                continue
            told = self.told[neighbour]
            missing = {r: d for r, d in known.items() if r != neighbour and r not in told}
            if missing or final:
                told.update(missing)
                out.append((neighbour, missing))
        return out

    def up(self, ending: Set[int]) -> Optional[int]:
        """The nearest ancestor not in ``ending`` that has not sent its final
        notice (None: this rank is the top)."""
        above = parent(self.rank)
        while above is not None and (above in ending or above in self.final):
            above = parent(above)
        return above

    def around(self, ending: Set[int], known: Dict[int, Departure],
               near_only: AbstractSet[int] = frozenset()) -> List[int]:
        """Every neighbour, routed around the ranks in ``ending`` and around
        those that sent their final notice lacking some of ``known`` (a
        final rank that lacks nothing is left out); the ranks in ``near_only``
        only where they are neighbours (at exit: ranks whose programs end, which
        may have ended already where they are not waiting for this rank)."""
        lacking = {n for n in self.final if any(r != n and r not in self.told[n] for r in known)}
        near = set(_neighbours(self.rank, self.size))
        return [rank for rank in reach(self.rank, self.size, ending | lacking, self.final - lacking)
                if rank in near or rank not in near_only]

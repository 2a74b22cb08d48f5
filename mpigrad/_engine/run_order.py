"""When a call's message runs may go out: in launch order, each once every
gradient of its buckets is marked ready (the same messages in the same order
on every rank, whatever order backward finishes the gradients in)."""

from typing import Dict, Iterable, List, Sequence, Set, Tuple

__all__ = ["LaunchOrder"]


class LaunchOrder:
    """The runs of one call and the gradients still missing from them.

    Args:
        runs: (first, last) bucket ranges, in launch order.
        bucket_of: {gradient position: its bucket} of the dense gradients.
        sizes: each bucket's number of gradients.
        count: the number of gradient positions of the call.
    """

    def __init__(self, runs: Sequence[Tuple[int, int]], bucket_of: Dict[int, int],
                 sizes: Sequence[int], count: int) -> None:
        self.runs = runs
        self.bucket_of = bucket_of
        self.missing = list(sizes)
        self.count = count
        self.marked: Set[int] = set()
        self.launched = 0                  # runs handed out by due()

    def mark(self, indices: Iterable[int]) -> None:
        """Gradients ``indices`` are final (each at most once)."""
        for index in indices:
            if index in self.marked:
                raise ValueError(f"ready: gradient {index} was already marked ready")
            if not 0 <= index < self.count:
                raise ValueError(f"ready: expecting gradient positions in [0, {self.count}), "
                                 f"got {index}")
            self.marked.add(index)
            bucket = self.bucket_of.get(index)
            if bucket is not None:
                self.missing[bucket] -= 1

    def due(self, complete_only: bool = True) -> List[Tuple[int, int]]:
        """The runs to launch now, in launch order: with ``complete_only`` up
        to the first whose buckets are not all ready, else all that are left."""
        runs, missing = self.runs, self.missing
        stop = self.launched
        while stop < len(runs) and not (complete_only
                                        and any(missing[runs[stop][0]:runs[stop][1] + 1])):
            stop += 1
        due = list(runs[self.launched:stop])
        self.launched = stop
        return due

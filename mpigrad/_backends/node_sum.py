"""The node sum's inner loop, shared by both node backends (shared buckets,
cross-memory): one rank's slice of a memory the local ranks each hold,
summed piece by piece in local rank order.

Only the owner of a slice computes it, so the additions are the same
whichever rank does them: results are bitwise equal everywhere and do not
depend on timing. Local ranks 0 and 1 hold an addend of the first addition:
their sum can grow in their own memory; the others' own addends are still to
be added then, so theirs go through a spare piece.
"""

from typing import Callable, Optional

import numpy as np

__all__ = ["sum_slice"]


def sum_slice(target: np.ndarray, start: int, stop: int, local: int, count: int,
              addend: Callable[[int, int, int, Optional[np.ndarray]], np.ndarray],
              incoming: np.ndarray, spare: np.ndarray,
              finish: Callable[[int, np.ndarray], None]) -> None:
    """Sum [start, stop) of the ``count`` local ranks' addends into
    ``target`` (this is local rank ``local``), in pieces of ``incoming.size``
    elements, in local rank order.

    ``addend(rank, lo, hi, into)`` gives local rank ``rank``'s [lo, hi): this
    rank's own memory or a peer's (shared memory), or ``into`` filled with it
    (read out of the peer). ``incoming`` and ``spare`` are 1-D arrays of the
    target's dtype, a piece each. ``finish(lo, piece)`` gets every summed
    piece, in ``target``, while it is in cache (the mean, the finite check,
    the push into the peers).
    """
    step = incoming.size
    direct = local < 2
    for lo in range(start, stop, step):
        hi = min(lo + step, stop)
        acc = target[lo:hi] if direct else spare[:hi - lo]
        if count == 1:                 # one rank on the node: its addend alone
            own = addend(0, lo, hi, None)
            if own.ctypes.data != acc.ctypes.data:
                acc[...] = own
        else:
            piece = incoming[:hi - lo]
            np.add(addend(0, lo, hi, piece if direct else acc), addend(1, lo, hi, piece),
                   out=acc)
            for rank in range(2, count):
                np.add(acc, addend(rank, lo, hi, piece), out=acc)
        if not direct:
            target[lo:hi] = acc
        finish(lo, target[lo:hi])

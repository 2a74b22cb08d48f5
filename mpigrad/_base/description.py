"""What the ranks of one checked collective agree on (pure): its Description,
the Description's fingerprint, and the report that names the first difference.

Each rank hashes what it is about to do into a 63-bit fingerprint; the ranks
compare fingerprints in one tiny collective (checked.py). Only when they
differ are the Descriptions gathered, and ``describe_mismatch`` names the
first difference: the call, a setting, the tree's structure, the number of
items, an item, or one of the caller's agreed values.
"""

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Tuple

__all__ = ["Description", "Pairs", "FINGERPRINT_MASK", "fingerprint", "part",
           "describe_mismatch", "array_item"]

#: fingerprints and checksums are 63-bit: non-negative in an int64, so that
#: one Allreduce(MAX) of (h, -h) compares them across ranks
FINGERPRINT_MASK = (1 << 63) - 1

#: (name, value) pairs, in an order every rank keeps (by name, unless a face
#: puts some first), whose repr is the same on ranks that agree
Pairs = Tuple[Tuple[str, Any], ...]


def fingerprint(value: Any) -> int:
    """A 63-bit hash of ``repr(value)``, equal on ranks whose values print alike."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & FINGERPRINT_MASK


@functools.lru_cache(maxsize=4096)
def array_item(dtype: Any, shape: Tuple[int, ...]) -> str:
    """An array's line in a Description: "float32[3, 4]" (made once per
    dtype and shape: small calls pay for every microsecond)."""
    return f"{dtype.name}{list(shape)}"


def part(name: str, value: Any) -> int:
    """The fingerprint of one part of a Description (0 for an empty part)."""
    return fingerprint((name, value)) if value else 0


@dataclass(frozen=True)
class Description:
    """One call as every rank must make it alike.

    Args:
        kind: the call ("reduce(inplace=True)", "broadcast", "allreduce", ...).
        settings: sorted (name, value) pairs: the Reducer's settings, an op, a root.
        items: one line per array of the call (a gradient's kind, dtype, shape).
        structure: the pytree's structure, keys included (None: no tree).
        agreed: the caller's values (``Reducer.reduce(agree=...)``).
        noun: what an item is called in a report ("gradient", "leaf", "tensor").
        paths: each item's path in the caller's tree, for a report (() : none).
    """

    kind: str
    settings: Pairs = ()
    items: Tuple[str, ...] = ()
    structure: Optional[str] = None
    agreed: Pairs = ()
    noun: str = field(default="gradient", compare=False)
    paths: Tuple[str, ...] = field(default=(), compare=False)

    @property
    def fingerprint(self) -> int:
        """Equal on ranks whose descriptions are equal (one hash of it all).
        A face that keeps parts of its calls' descriptions may instead XOR
        the parts' fingerprints (``part``), as the Reducer does; every rank
        of that face then does the same."""
        return fingerprint((self.kind, self.settings, self.items, self.structure, self.agreed))


def describe_mismatch(descriptions: Sequence[Optional[Description]]) -> str:
    """Name the first difference between the ranks' descriptions (in rank
    order; None: a rank that took part without one, as Horovod's joined ranks)."""
    present = [(rank, d) for rank, d in enumerate(descriptions) if d is not None]
    for rank, theirs in present[1:]:
        found = theirs != present[0][1] and _first_difference(present[0], (rank, theirs))
        if found:
            return found
    return "ranks disagree on the call, but their descriptions are equal (hash collision?)"


def _first_difference(reference: Tuple[int, Description], other: Tuple[int, Description]) -> str:
    (first, mine), (rank, theirs) = reference, other
    if mine.kind != theirs.kind:
        return (f"expecting the same call on every rank, got {mine.kind} on rank {first} and "
                f"{theirs.kind} on rank {rank}: their messages would not match; make every "
                "rank call alike")
    setting = _differing(mine.settings, theirs.settings)
    if setting is not None:
        key, ours, others = setting
        return (f"setting {key!r} differs across ranks: rank {first} has {ours!r}, "
                f"rank {rank} has {others!r}; pass the same on every rank (a "
                "Reducer: construct it alike everywhere)")
    if mine.structure != theirs.structure:
        tree = "gradient tree" if mine.noun == "gradient" else "tree"
        return (f"{tree} structure differs across ranks: rank {first} has {mine.structure}, "
                f"rank {rank} has {theirs.structure}; pass the same keys and nesting everywhere")
    if len(mine.items) != len(theirs.items):
        return (f"number of {mine.noun}s differs across ranks: rank {first} has {len(mine.items)}, "
                f"rank {rank} has {len(theirs.items)}")
    for index, (a, b) in enumerate(zip(mine.items, theirs.items)):
        if a != b:
            path = f" ({mine.paths[index]})" if index < len(mine.paths) else ""
            return (f"{mine.noun} {index}{path} differs across ranks: rank {first} has {a}, "
                    f"rank {rank} has {b}")
    value = _differing(mine.agreed, theirs.agreed)
    if value is not None:
        name, ours, others = value
        return (f"{name!r} differs across ranks: rank {first} has {ours!r}, rank "
                f"{rank} has {others!r}; some rank made a call (or a step) that "
                "the others did not")
    return ""


def _differing(mine: Pairs, theirs: Pairs) -> Optional[Tuple[str, Any, Any]]:
    """(name, mine, theirs) of the first name whose values differ (a missing
    name: None), in the pairs' order (Settings.agreed puts first the settings
    that set others), or None."""
    ours, others = dict(mine), dict(theirs)
    for name in dict.fromkeys([*ours, *others]):
        if ours.get(name) != others.get(name):
            return name, ours.get(name), others.get(name)
    return None

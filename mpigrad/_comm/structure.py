"""Cross-rank structure check, the pure part: fingerprints and mismatch reports.

Each rank hashes what it is about to do (its gradient signature and the
reducer's settings) into a 63-bit fingerprint; the ranks compare fingerprints
in one tiny collective (comm.py). Only when they differ is the full
description gathered, and ``describe_mismatch`` names the first difference.
"""

import hashlib

__all__ = ["describe", "with_structure", "with_agreed", "fingerprint", "describe_mismatch"]

_MASK = (1 << 63) - 1


def _gradient(spec):
    if spec.kind == "skip":
        return "skipped"
    text = f"{spec.kind} {spec.dtype.name}{list(spec.shape)}"
    if spec.index_dtype is not None:
        text += f" indices {spec.index_dtype.name}"
    return text


def describe(specs, settings):
    """A picklable description: (settings as sorted items, one string per gradient)."""
    return tuple(sorted(settings.items())), tuple(_gradient(s) for s in specs)


def with_structure(description, structure):
    """``description`` with the gradient tree's structure (keys included) added."""
    settings, grads = description
    return (("structure", structure),) + settings, grads


def with_agreed(description, agreed):
    """``description`` with the caller's agreed values (``validate.agreed``:
    sorted (name, value) pairs) added."""
    settings, grads = description
    return (("agreed", agreed),) + settings, grads


def fingerprint(description):
    """A 63-bit hash of a description, equal on ranks that agree."""
    digest = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def describe_mismatch(descriptions):
    """Name the first difference between the ranks' descriptions."""
    reference = descriptions[0]
    for rank, (settings, grads) in enumerate(descriptions):
        if rank == 0 or (settings, grads) == reference:
            continue
        agreed = None      # the caller's values: named after the gradients
        for (key, mine), (_, theirs) in zip(reference[0], settings):
            if mine != theirs and key == "agreed":
                agreed = _agreed_mismatch(dict(mine), dict(theirs), rank)
            elif mine != theirs and key == "structure":
                return (f"gradient tree structure differs across ranks: rank 0 has {mine}, "
                        f"rank {rank} has {theirs}; pass the same keys and nesting everywhere")
            elif mine != theirs:
                return (f"setting {key!r} differs across ranks: rank 0 has {mine!r}, "
                        f"rank {rank} has {theirs!r}; pass the same on every rank (a Reducer: "
                        "construct it alike everywhere)")
        if len(reference[1]) != len(grads):
            return (f"number of gradients differs across ranks: rank 0 has "
                    f"{len(reference[1])}, rank {rank} has {len(grads)}")
        for index, (mine, theirs) in enumerate(zip(reference[1], grads)):
            if mine != theirs:
                return (f"gradient {index} differs across ranks: rank 0 has {mine}, "
                        f"rank {rank} has {theirs}")
        if agreed:
            return agreed
    return "ranks disagree on the reduction, but their descriptions are equal (hash collision?)"


def _agreed_mismatch(mine, theirs, rank):
    """Name the first of the caller's agreed values that differs."""
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            return (f"{name!r} differs across ranks: rank 0 has {mine.get(name)!r}, rank "
                    f"{rank} has {theirs.get(name)!r}; some rank made a call (or a step) that "
                    "the others did not")
    return "the agreed values differ across ranks"

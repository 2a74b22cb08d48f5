"""Argument checks shared by every constructor and function, so that the same
argument is checked the same way everywhere (messages: expected vs got)."""

import numbers
import operator
import os
from typing import Any, Callable, Collection, Literal, Optional, Tuple, overload

import numpy as np

__all__ = ["positive_int", "seconds", "one_of", "from_environment", "flag", "rank_of",
           "agreed", "check_split_indices", "check_bucket_bytes"]

_PLAIN = (bool, int, float, str, type(None))


@overload
def positive_int(name: str, value: Any) -> int: ...
@overload
def positive_int(name: str, value: Any, *, none_ok: Literal[True]) -> Optional[int]: ...


def positive_int(name: str, value: Any, *, none_ok: bool = False) -> Optional[int]:
    """``value`` as an int > 0 (numpy integers accepted, bools rejected)."""
    if value is None and none_ok:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or value <= 0:
        expect = "an int > 0 or None" if none_ok else "an int > 0"
        raise ValueError(f"{name}: expecting {expect}, got {value!r}")
    return int(value)


def flag(name: str, value: Any) -> bool:
    """``value`` as a bool: True or False (numpy's bools accepted); no other
    value, since ``mean="no"`` would otherwise read as True."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}: expecting True or False, got {value!r}")
    return bool(value)


def rank_of(name: str, value: Any, size: int) -> int:
    """``value`` as a rank of a communicator of ``size`` ranks: an int (numpy
    integers accepted, bools and floats not) in [0, size)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or not 0 <= int(value) < size:
        raise ValueError(f"{name}: expecting a rank, an int in [0, {size}), got {value!r}")
    return int(value)


def seconds(name: str, value: Any) -> Optional[float]:
    """``value`` as seconds > 0, or None for none (0 and None both mean none)."""
    if (type(value) is float or type(value) is int) and value > 0:    # (every call's)
        return float(value)
    if value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool)
                         and value == 0):
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) \
            or not float(value) > 0:
        raise ValueError(f"{name}: expecting seconds > 0 or None, got {value!r}")
    return float(value)


def one_of(name: str, value: Any, options: Collection[Any]) -> Any:
    """``value`` if it is one of ``options``."""
    if value not in options:
        raise ValueError(f"{name}: expecting one of {tuple(options)}, got {value!r}")
    return value


def from_environment(variable: str, value: Any, parse: Callable[[str, int], Any]) -> Any:
    """``value`` if given (not None), else environment ``variable`` parsed by
    ``parse(name, value)`` if set, else None: an explicit argument wins."""
    if value is not None:
        return value
    text = os.environ.get(variable, "").strip()
    if not text:
        return None
    try:
        number = int(text)
    except ValueError:
        raise ValueError(f"{variable}: expecting an int > 0 (bytes), got {text!r}") from None
    return parse(variable, number)


def agreed(name: str, values: Any) -> Tuple[Tuple[str, Any], ...]:
    """``values`` (a dict of names to plain values: bool, int, float, str,
    None or tuples of them) as sorted (name, value) pairs, whose repr is the
    same on every rank that has the same values; None: no values."""
    if values is None:
        return ()
    if not isinstance(values, dict):
        raise TypeError(f"{name}: expecting a dict of names to values, got "
                        f"{type(values).__name__}")
    for key, value in values.items():
        if not isinstance(key, str) or not _plain(value):
            raise TypeError(f"{name}: expecting str names and values of bool, int, float, str, "
                            f"None or tuples of them, got {key!r}: {value!r}")
    return tuple(sorted((key, _python(value)) for key, value in values.items()))


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(map(_plain, value))
    return isinstance(value, _PLAIN) or isinstance(value, (np.integer, np.floating, np.bool_))


def _python(value: Any) -> Any:
    """numpy scalars as python's, so that equal values print alike."""
    if isinstance(value, tuple):
        return tuple(map(_python, value))
    return value.item() if isinstance(value, np.generic) else value


def check_split_indices(split_indices: Any) -> Optional[Tuple[int, ...]]:
    """Validate split indices on their own; return them as a tuple of ints."""
    if split_indices is None:
        return None
    if isinstance(split_indices, (str, bytes)) or not hasattr(split_indices, "__iter__"):
        raise ValueError(f"split_indices: expecting a sequence of ints, "
                         f"got {split_indices!r}")
    out = []
    for s in split_indices:
        if isinstance(s, (bool, np.bool_)):
            raise ValueError(f"split_indices: expecting ints, got {s!r} in {split_indices!r}")
        try:
            out.append(operator.index(s))
        except TypeError:
            raise ValueError(f"split_indices: expecting ints, got {s!r} "
                             f"in {list(split_indices)!r}") from None
    if any(s <= 0 for s in out):
        raise ValueError(f"split_indices: expecting boundaries > 0, got {out}")
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"split_indices: expecting strictly increasing boundaries, "
                         f"got {out}")
    return tuple(out)


def check_bucket_bytes(bucket_bytes: Any) -> Optional[int]:
    """Validate the bucket cap; None means the default."""
    return positive_int("bucket_bytes", bucket_bytes, none_ok=True)

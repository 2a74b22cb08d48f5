"""Argument checks shared by every constructor and function, so that the same
argument is checked the same way everywhere (messages: expected vs got)."""

import numbers

import numpy as np

__all__ = ["positive_int", "seconds", "one_of"]


def positive_int(name, value, *, none_ok=False):
    """``value`` as an int > 0 (numpy integers accepted, bools rejected)."""
    if value is None and none_ok:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or value <= 0:
        expect = "an int > 0 or None" if none_ok else "an int > 0"
        raise ValueError(f"{name}: expecting {expect}, got {value!r}")
    return int(value)


def seconds(name, value):
    """``value`` as seconds > 0, or None for none (0 and None both mean none)."""
    if value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool)
                         and value == 0):
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) \
            or not value > 0:
        raise ValueError(f"{name}: expecting seconds > 0 or None, got {value!r}")
    return float(value)


def one_of(name, value, options):
    """``value`` if it is one of ``options``."""
    if value not in options:
        raise ValueError(f"{name}: expecting one of {tuple(options)}, got {value!r}")
    return value

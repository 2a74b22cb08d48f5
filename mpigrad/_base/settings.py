"""A Reducer's settings: validated once at construction, immutable after.

One Settings object feeds the plan cache, the cross-rank fingerprint and the
mismatch report, so a plan can never outlive the settings it was made for.
"""

import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np

from .exact import MAX_TERMS
from .libc import environment_bytes
from .row_sparse import SPARSE_MODES
from .validate import (check_bucket_bytes, check_split_indices, flag, from_environment, one_of,
                       positive_int, seconds)

#: what float32 buckets travel as between ranks (Reducer's wire=): None, their own dtype;
#: "bfloat16" or "float16", rounded once at the sender, summed in float32
#: (mpigrad/_backends/wire.py)
WIRES = (None, "bfloat16", "float16")

__all__ = ["Settings", "DEFAULT_TIMEOUT", "DEFAULT_CHUNK_BYTES", "UNSET", "resolve_timeout"]

#: Largest message one Allreduce call carries; larger buckets are reduced in
#: pieces: MPICH's shared-memory path is faster on 2-4 MiB messages than on a
#: whole 100 MiB buffer (docs/performance.md; ``mpigrad-bench --tune`` finds
#: the best size on a given machine).
DEFAULT_CHUNK_BYTES = 4 << 20

#: The watchdog's default limit, as torch's process groups: a collective that
#: waits longer aborts the job with a diagnostic.
DEFAULT_TIMEOUT = 600.0


class _Unset:
    def __repr__(self) -> str:
        return f"{DEFAULT_TIMEOUT:g} s or MPIGRAD_TIMEOUT"


#: the default of ``timeout`` arguments: MPIGRAD_TIMEOUT if set, else DEFAULT_TIMEOUT
UNSET: Any = _Unset()


def resolve_timeout(timeout: Any = UNSET) -> Optional[float]:
    """The watchdog timeout in seconds, or None (off): an explicit ``timeout``
    wins; else MPIGRAD_TIMEOUT (0 turns the watchdog off); else DEFAULT_TIMEOUT."""
    if timeout is UNSET:
        timeout_set: Optional[float] = _environment("MPIGRAD_TIMEOUT", _timeout_text)
        return timeout_set
    return seconds("timeout", timeout)


def _timeout_text(text: str) -> Optional[float]:
    if not text:
        return DEFAULT_TIMEOUT
    try:
        timeout = float(text)
    except ValueError:
        raise ValueError(f"MPIGRAD_TIMEOUT: expecting seconds as a number (0: off), "
                         f"got {text!r}") from None
    return seconds("MPIGRAD_TIMEOUT", timeout)


#: environment values parsed, by (variable, its bytes or None): read at every call that
#: takes them (a launcher or a test may change them between calls), parsed once per value
_PARSED: Dict[Tuple[str, Optional[bytes]], Any] = {}


def _environment(variable: str, parse: Callable[[str], Any]) -> Any:
    """``parse`` of environment ``variable``'s text, stripped ("" where unset); its
    error raised (a bad text is parsed again next time)."""
    raw = environment_bytes(variable.encode())
    key = (variable, raw)
    value = _PARSED.get(key, _PARSED)            # (the dict itself: not parsed yet)
    if value is _PARSED:
        value = parse(os.fsdecode(raw).strip() if raw is not None else "")
        if len(_PARSED) >= 64:
            _PARSED.clear()
        _PARSED[key] = value
    return value


def wire_setting(wire: Any) -> Optional[str]:
    """``wire`` if given, else MPIGRAD_WIRE where set (so that the faces that make their
    own Reducers, the torch.distributed backend among them, take it too), else None."""
    if wire is None:
        wire = os.environ.get("MPIGRAD_WIRE", "").strip() or None
        if wire is not None and wire not in WIRES:
            raise ValueError(f"MPIGRAD_WIRE: expecting one of {WIRES[1:]} (or unset), "
                             f"got {wire!r}")
    value: Optional[str] = one_of("wire", wire, WIRES)
    return value


#: settings that set others (Settings.validated), compared first
_SETTING_OTHERS = ("reproducible",)


def reproducible_setting(reproducible: Any) -> bool:
    """``reproducible`` if given, else MPIGRAD_REPRODUCIBLE ("1" or "0") where set (so
    that the faces that make their own Reducers take it too), else False."""
    if reproducible is None:
        return bool(_environment("MPIGRAD_REPRODUCIBLE", _reproducible_text))
    return flag("reproducible", reproducible)


def _reproducible_text(text: str) -> bool:
    if text not in ("", "0", "1"):
        raise ValueError(f"MPIGRAD_REPRODUCIBLE: expecting 1 or 0 (or unset), got {text!r}")
    return text == "1"


def node_size_override() -> Optional[int]:
    """MPIGRAD_NODE_SIZE as an int (every k consecutive world ranks form one
    node; for tests and the bench), or None when unset."""
    text = os.environ.get("MPIGRAD_NODE_SIZE", "").strip()
    if not text:
        return None
    try:
        return positive_int("MPIGRAD_NODE_SIZE", int(text))
    except ValueError:
        raise ValueError(f"MPIGRAD_NODE_SIZE: expecting an int > 0 (ranks per node), "
                         f"got {text!r}") from None


def _mode(name: str, value: Any) -> Union[str, bool]:
    """'auto', True or False (numpy's bools accepted)."""
    if isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name}: expecting 'auto', True or False, got {value!r}")


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


@dataclass(frozen=True)
class Settings:
    """What a Reducer was constructed with (see Reducer for each meaning)."""

    mean: bool = True
    degree: Optional[int] = None            # None: the communicator size
    split_indices: Optional[Tuple[int, ...]] = None
    bucket_bytes: Optional[int] = None
    skip: Optional[Tuple[bool, ...]] = None
    sparse: str = "auto"
    check: bool = True
    timeout: Optional[float] = DEFAULT_TIMEOUT
    verify: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    check_finite: bool = False
    shared_memory: Union[str, bool] = "auto"
    cross_memory: Union[str, bool] = "auto"
    on_failure: str = "abort"
    wire: Optional[str] = None
    reproducible: bool = False
    node_size: Optional[int] = None         # MPIGRAD_NODE_SIZE (tests, bench)

    @classmethod
    def validated(cls, *, mean: Any = True, degree: Any = None, split_indices: Any = None,
                  bucket_bytes: Any = None, skip: Any = None, sparse: Any = "auto",
                  check: Any = True, timeout: Any = UNSET, verify: Any = False,
                  chunk_bytes: Any = None, check_finite: Any = False,
                  shared_memory: Any = "auto", cross_memory: Any = "auto",
                  on_failure: Any = "abort", wire: Any = None,
                  reproducible: Any = None) -> "Settings":
        """Settings from constructor arguments (the defaults: Reducer's) and the
        environment variables mpigrad reads; ValueError names a bad one."""
        mean, check, verify, check_finite = (flag(name, value) for name, value in (
            ("mean", mean), ("check", check), ("verify", verify),
            ("check_finite", check_finite)))
        shared_memory = _mode("shared_memory", shared_memory)
        cross_memory = _mode("cross_memory", cross_memory)
        if cross_memory is True and shared_memory is False:
            raise ValueError("cross_memory=True needs shared_memory='auto' or True: node sums "
                             "are off with shared_memory=False")
        if shared_memory is True and not check:
            raise ValueError("shared_memory=True needs check=True: the per-call check is "
                             "where the ranks of a node agree to set up shared buckets")
        on_failure = one_of("on_failure", on_failure, ("abort", "shrink"))
        if on_failure == "shrink":
            # (whether the MPI library can shrink is the engine's to check)
            if shared_memory is True or cross_memory is True:
                raise ValueError("on_failure='shrink' cannot be combined with shared_memory="
                                 "True or cross_memory=True: node sums write the caller's "
                                 "memory as they go, and are not rebuilt after a shrink")
        reproducible = reproducible_setting(reproducible)
        if reproducible:
            # exact sums: no wire; no node sums but the exact one's (mpigrad._backends.select)
            if wire is not None:
                raise ValueError(f"reproducible=True cannot be combined with wire={wire!r}: the "
                                 "wire rounds every addend; the exact sum rounds only the result")
            if shared_memory is True or cross_memory is True:
                raise ValueError("reproducible=True cannot be combined with shared_memory=True "
                                 "or cross_memory=True: exact sums are integer sums, through "
                                 "cross-memory on one node where it can be had; leave them "
                                 "'auto' (or False)")
            if isinstance(degree, int) and degree >= MAX_TERMS:
                raise ValueError(f"degree: reproducible=True divides exactly by a degree below "
                                 f"{MAX_TERMS}, got {degree}")
        if (shared_memory is True or cross_memory is True) and verify:
            raise ValueError("shared_memory=True or cross_memory=True cannot be combined "
                             "with verify=True: "
                             "verify reduces into private memory through MPI")
        return cls(mean=mean, degree=positive_int("degree", degree, none_ok=True),
                   split_indices=check_split_indices(split_indices),
                   bucket_bytes=check_bucket_bytes(from_environment(
                       "MPIGRAD_BUCKET_BYTES", bucket_bytes, positive_int)),
                   skip=None if skip is None else tuple(bool(s) for s in skip),
                   sparse=one_of("sparse", sparse, SPARSE_MODES), check=check,
                   timeout=resolve_timeout(timeout), verify=verify,
                   chunk_bytes=positive_int("chunk_bytes", _default(from_environment(
                       "MPIGRAD_CHUNK_BYTES", chunk_bytes, positive_int), DEFAULT_CHUNK_BYTES)),
                   check_finite=check_finite, shared_memory=shared_memory,
                   cross_memory=cross_memory, on_failure=on_failure,
                   wire=None if reproducible else wire_setting(wire),
                   reproducible=bool(reproducible), node_size=node_size_override())

    def agreed(self) -> Tuple[Tuple[str, Any], ...]:
        """The settings every rank must share, as a Description's (name, value)
        pairs: first those that set others (``reproducible`` turns off the
        node sums and the wire), so that a mismatch names what the user set,
        then the rest by name."""
        values = {k: v for k, v in asdict(self).items() if k != "skip"}
        first = [(k, values.pop(k)) for k in _SETTING_OTHERS]
        return tuple(first + sorted(values.items()))

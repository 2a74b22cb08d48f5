"""A Reducer's settings: validated once at construction, immutable after.

One Settings object feeds the plan cache, the cross-rank fingerprint and the
mismatch report, so a plan can never outlive the settings it was made for.
"""

from dataclasses import asdict, dataclass

import numpy as np

from .comm import DEFAULT_CHUNK_BYTES, DEFAULT_TIMEOUT, resolve_timeout
from .plan import check_bucket_bytes, check_split_indices
from .sparse import SPARSE_MODES
from .ulfm import ulfm_problem
from .validate import from_environment, one_of, positive_int

__all__ = ["Settings"]


def _shared_memory_mode(value):
    if isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"shared_memory: expecting 'auto', True or False, got {value!r}")


def _default(value, default):
    return default if value is None else value


@dataclass(frozen=True)
class Settings:
    """What a Reducer was constructed with (see Reducer for each meaning)."""

    mean: bool = True
    degree: int = None            # None: the communicator size
    split_indices: tuple = None
    bucket_bytes: int = None
    skip: tuple = None
    sparse: str = "auto"
    check: bool = True
    timeout: float = DEFAULT_TIMEOUT
    verify: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    check_finite: bool = False
    shared_memory: object = "auto"
    on_failure: str = "abort"

    @classmethod
    def validated(cls, *, mean, degree, split_indices, bucket_bytes, skip, sparse, check,
                  timeout, verify, chunk_bytes, check_finite, shared_memory, on_failure):
        """Settings from constructor arguments; ValueError names a bad one."""
        shared_memory = _shared_memory_mode(shared_memory)
        if shared_memory is True and not check:
            raise ValueError("shared_memory=True needs check=True: the per-call check is "
                             "where the ranks of a node agree to set up shared buckets")
        on_failure = one_of("on_failure", on_failure, ("abort", "shrink"))
        if on_failure == "shrink":
            problem = ulfm_problem()
            if problem is not None:
                raise ValueError(f"on_failure='shrink': {problem}")
            if shared_memory is True:
                raise ValueError("on_failure='shrink' cannot be combined with "
                                 "shared_memory=True: node memory is not rebuilt after a shrink")
        if shared_memory is True and verify:
            raise ValueError("shared_memory=True cannot be combined with verify=True: "
                             "verify reduces into private memory through MPI")
        return cls(mean=bool(mean), degree=positive_int("degree", degree, none_ok=True),
                   split_indices=check_split_indices(split_indices),
                   bucket_bytes=check_bucket_bytes(from_environment(
                       "MPIGRAD_BUCKET_BYTES", bucket_bytes, positive_int)),
                   skip=None if skip is None else tuple(bool(s) for s in skip),
                   sparse=one_of("sparse", sparse, SPARSE_MODES), check=bool(check),
                   timeout=resolve_timeout(timeout), verify=bool(verify),
                   chunk_bytes=positive_int("chunk_bytes", _default(from_environment(
                       "MPIGRAD_CHUNK_BYTES", chunk_bytes, positive_int), DEFAULT_CHUNK_BYTES)),
                   check_finite=bool(check_finite), shared_memory=shared_memory,
                   on_failure=on_failure)

    def agreed(self):
        """The settings every rank must share, for the cross-rank fingerprint."""
        return {k: v for k, v in asdict(self).items() if k != "skip"}

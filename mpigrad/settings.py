"""A Reducer's settings: validated once at construction, immutable after.

One Settings object feeds the plan cache, the cross-rank fingerprint and the
mismatch report, so a plan can never outlive the settings it was made for.
"""

from dataclasses import asdict, dataclass

from .comm import DEFAULT_CHUNK_BYTES, DEFAULT_TIMEOUT, resolve_timeout
from .plan import check_bucket_bytes, check_split_indices
from .sparse import SPARSE_MODES
from .validate import from_environment, one_of, positive_int

__all__ = ["Settings"]


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

    @classmethod
    def validated(cls, *, mean, degree, split_indices, bucket_bytes, skip, sparse, check,
                  timeout, verify, chunk_bytes, check_finite):
        """Settings from constructor arguments; ValueError names a bad one."""
        return cls(mean=bool(mean), degree=positive_int("degree", degree, none_ok=True),
                   split_indices=check_split_indices(split_indices),
                   bucket_bytes=check_bucket_bytes(from_environment(
                       "MPIGRAD_BUCKET_BYTES", bucket_bytes, positive_int)),
                   skip=None if skip is None else tuple(bool(s) for s in skip),
                   sparse=one_of("sparse", sparse, SPARSE_MODES), check=bool(check),
                   timeout=resolve_timeout(timeout), verify=bool(verify),
                   chunk_bytes=positive_int("chunk_bytes", _default(from_environment(
                       "MPIGRAD_CHUNK_BYTES", chunk_bytes, positive_int), DEFAULT_CHUNK_BYTES)),
                   check_finite=bool(check_finite))

    def agreed(self):
        """The settings every rank must share, for the cross-rank fingerprint."""
        return {k: v for k, v in asdict(self).items() if k != "skip"}

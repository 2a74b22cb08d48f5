"""mpigrad: fused MPI reduction of the gradients of any array-based trainer.

The names that need MPI (Reducer, broadcast, allreduce, install_abort_handler)
are imported on first use, so that ``import mpigrad`` alone does not start MPI
(the benchmark sets the MPI library's transport switches before it does).
"""

from importlib import import_module

from . import elastic
from .dtypes import bfloat16
from .errors import (
    DivergenceError,
    MpigradError,
    PeerError,
    RanksLost,
    StructureMismatchError,
)
from .overlap import PendingReduction
from .plan import DEFAULT_BUCKET_BYTES, Bucket, FusionPlan
from .sparse import RowSparse

__all__ = ["Reducer", "elastic", "PendingReduction", "RowSparse", "FusionPlan", "Bucket", "broadcast",
           "allreduce", "install_abort_handler", "bfloat16", "DEFAULT_BUCKET_BYTES",
           "MpigradError", "StructureMismatchError", "PeerError", "DivergenceError", "RanksLost"]
__version__ = "0.1.0"

_WITH_MPI = {"Reducer": ".reducer", "broadcast": ".collectives", "allreduce": ".collectives",
             "install_abort_handler": ".comm"}


def __getattr__(name):
    if name in _WITH_MPI:
        value = getattr(import_module(_WITH_MPI[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mpigrad' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))

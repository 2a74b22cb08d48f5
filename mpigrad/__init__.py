"""mpigrad: fused MPI reduction of the gradients of any array-based trainer.

The names that need MPI (Reducer, PendingReduction, broadcast, allreduce,
install_abort_handler, statistics, rank and size: this process's rank in MPI's
world and the world's size, to shard data by) are imported on first use, so that ``import mpigrad``
alone does not start MPI (the benchmark sets the MPI library's transport
switches before it does), and so is ``bfloat16`` (ml_dtypes' import takes 0.6 s);
type checkers see them as usual.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any, List

from . import elastic
from ._engine.plan import DEFAULT_BUCKET_BYTES, Bucket, FusionPlan
from ._base.row_sparse import RowSparse
from ._base.exact_sum import ExactSum
from ._base.errors import (
    DivergenceError,
    LaunchError,
    MpigradError,
    PeerError,
    RanksLost,
    StructureMismatchError,
    TimedOut,
)

if TYPE_CHECKING:
    from ._base.dtypes import bfloat16
    from ._engine.world import install_abort_handler, world_rank as rank, world_size as size
    from ._collective import Statistics, statistics
    from .collectives import allgather_object, allreduce, broadcast
    from .reducer import PendingReduction, PendingShards, Reducer

__all__ = ["Reducer", "elastic", "PendingReduction", "PendingShards", "RowSparse", "ExactSum",
           "FusionPlan", "Bucket",
           "broadcast", "allreduce", "allgather_object", "install_abort_handler", "statistics",
           "Statistics", "bfloat16", "DEFAULT_BUCKET_BYTES", "rank", "size",
           "MpigradError", "StructureMismatchError", "PeerError", "DivergenceError", "RanksLost",
           "TimedOut", "LaunchError"]
__version__ = "0.1.0"

#: the names imported on first use: (their module, their name there)
_ON_FIRST_USE = {
    **{name: (".reducer", name) for name in ("Reducer", "PendingReduction", "PendingShards")},
    **{name: (".collectives", name) for name in ("broadcast", "allreduce", "allgather_object")},
    "install_abort_handler": ("._engine.world", "install_abort_handler"),
    "rank": ("._engine.world", "world_rank"), "size": ("._engine.world", "world_size"),
    "statistics": ("._collective", "statistics"), "Statistics": ("._collective", "Statistics"),
    "bfloat16": ("._base.dtypes", "bfloat16")}


def __getattr__(name: str) -> Any:
    if name in _ON_FIRST_USE:
        module, attribute = _ON_FIRST_USE[name]
        value = getattr(import_module(module, __name__), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mpigrad' has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))

"""mpigrad: fused MPI reduction of the gradients of any array-based trainer."""

from .collectives import allreduce, broadcast
from .comm import install_abort_handler
from .dtypes import bfloat16
from .errors import DivergenceError, MpigradError, PeerError, StructureMismatchError
from .overlap import PendingReduction
from .plan import DEFAULT_BUCKET_BYTES, Bucket, FusionPlan
from .reducer import Reducer
from .sparse import RowSparse

__all__ = ["Reducer", "PendingReduction", "RowSparse", "FusionPlan", "Bucket", "broadcast", "allreduce",
           "install_abort_handler", "bfloat16", "DEFAULT_BUCKET_BYTES",
           "MpigradError", "StructureMismatchError", "PeerError", "DivergenceError"]
__version__ = "0.1.0"

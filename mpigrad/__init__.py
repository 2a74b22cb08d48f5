"""mpigrad: fused MPI reduction of the gradients of any array-based trainer."""

from .comm import broadcast
from .dtypes import bfloat16
from .errors import MpigradError, PeerError, StructureMismatchError
from .plan import DEFAULT_BUCKET_BYTES, Bucket, FusionPlan
from .reducer import Reducer
from .sparse import RowSparse

__all__ = ["Reducer", "RowSparse", "broadcast", "FusionPlan", "Bucket", "DEFAULT_BUCKET_BYTES", "bfloat16",
           "MpigradError", "PeerError", "StructureMismatchError"]
__version__ = "0.1.0"

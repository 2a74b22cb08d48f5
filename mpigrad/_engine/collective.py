"""The one checked collective as the faces see it (mpigrad.collectives, the
Horovod layer): a face never imports ``_comm`` or ``_backends`` itself, and
never starts an MPI call itself; every collective it makes is a call of this
seam: ``checked`` (the local checks and the one agreement), then a start on
the Communicator (through the watch's pre-start check), then a ``Pending``
waited on under the watch (see mpigrad._comm.checked). The benchmark's
baselines (MPI's own collectives, timed beside mpigrad's) take their
datatypes from here too."""

import numpy as np

from .._backends.flight import Sums
from .._comm.checked import Checked, Pending, checked
from .._comm.communicator import Communicator, Started, install_abort_handler, mpi_datatype
from .._comm.description import Description, describe_mismatch, fingerprint
from .._comm.ulfm import ulfm_problem

__all__ = ["Checked", "Communicator", "Description", "Pending", "Started", "checked",
           "describe_mismatch", "fingerprint", "install_abort_handler", "mpi_datatype",
           "ulfm_problem", "sum_on_wire"]


def sum_on_wire(communicator: Communicator, flat: np.ndarray, wire: str, what: str) -> None:
    """Sum the 1-D float32 ``flat`` over ``communicator`` in place through ``wire``
    ("bfloat16" or "float16": mpigrad._backends.wire), in pieces of its chunk_bytes,
    watched; after the call's agreement, as every collective here."""
    sums = Sums(communicator, wire)
    for lo, hi in sums.cuts(flat):
        sums.add(flat[lo:hi], what)
    sums.progress()
    sums.finish()

"""The communicator's seam for the two layers that still hold communicators:
the Horovod layer (its matching rounds, process sets and Adasum exchanges are
not yet Collectives of mpigrad._engine.group, the faces' one typed
collective) and the benchmark (its baselines are MPI's own collectives, timed
beside mpigrad's). Every other face translates onto mpigrad._engine.group and
never imports mpi4py (setup.cfg's import contract); so will the Horovod layer,
and then these names go."""

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

"""The one checked collective as the faces see it (mpigrad.collectives, the
Horovod layer): a face never imports ``_comm`` or ``_backends`` itself, and
never starts an MPI call itself; every collective it makes is a call of this
seam: ``checked`` (the local checks and the one agreement), then a start on
the Communicator (through the watch's pre-start check), then a ``Pending``
waited on under the watch (see mpigrad._comm.checked). The benchmark's
baselines (MPI's own collectives, timed beside mpigrad's) take their
datatypes from here too."""

from .._comm.checked import Checked, Pending, checked
from .._comm.communicator import Communicator, Started, install_abort_handler, mpi_datatype
from .._comm.description import Description, describe_mismatch, fingerprint
from .._comm.ulfm import ulfm_problem

__all__ = ["Checked", "Communicator", "Description", "Pending", "Started", "checked",
           "describe_mismatch", "fingerprint", "install_abort_handler", "mpi_datatype",
           "ulfm_problem"]

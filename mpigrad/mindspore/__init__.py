"""MindSpore integration: MindSpore's ``DistributedGradReducer`` on MPI, for
training on CPU clusters (PyNative, or compiled: GRAPH_MODE and ``ms.jit``)
under ``mpiexec`` or ``srun`` (no scheduler, ``msrun`` or ``init()``).

Imported only by users who ``import mpigrad.mindspore``; MindSpore stays optional.

    from mpigrad.mindspore import DistributedGradReducer, broadcast_parameters
    broadcast_parameters(net.trainable_params(), root=0)
    grad_reducer = DistributedGradReducer(optimizer.parameters, mean=True)   # over MPI's ranks
    grads = grad_reducer(grads)                   # in the step, before the optimizer

``init``, ``get_rank`` and ``get_group_size`` stand in for
``mindspore.communication``'s, with MPI's ranks.
"""

from .collectives import allreduce, broadcast_parameters
from .launch import get_group_size, get_rank, init
from .reducer import DistributedGradReducer

__all__ = ["DistributedGradReducer", "broadcast_parameters", "allreduce", "init", "get_rank",
           "get_group_size"]

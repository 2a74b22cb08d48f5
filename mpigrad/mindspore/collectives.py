"""The training state's broadcast and the metrics' allreduce for MindSpore
tensors and parameters, over mpigrad's checked collectives."""

from typing import Any, Dict, Iterable, Union

import mindspore as ms
import numpy as np

from .. import collectives
from .launch import communicator
from .tensors import to_numpy, to_tensor

__all__ = ["broadcast_parameters", "allreduce"]


def broadcast_parameters(parameters: Union[Dict[str, Any], Iterable[Any]], root: int = 0,
                         group: Any = None) -> None:
    """Give every rank ``root``'s values of ``parameters`` (``net.trainable_params()``,
    ``net.parameters_dict()`` or a list of Parameters), set with ``set_data``;
    their names, shapes and dtypes are compared across ranks first (a
    difference raises StructureMismatchError on every rank, nothing set).
    ``group`` as in DistributedGradReducer. Outside compiled code."""
    params = list(parameters.values() if isinstance(parameters, dict) else parameters)
    hosts = {p.name: np.array(to_numpy(p)) for p in params}     # writeable copies
    with communicator(group) as comm:
        hosts = collectives.broadcast(hosts, root=root, comm=comm)
    for p in params:
        p.set_data(to_tensor(hosts[p.name]))


def allreduce(value: Any, op: str = "mean", group: Any = None) -> Any:
    """``mpigrad.allreduce`` of a MindSpore tensor (a metric, an overflow
    flag: ``op`` "sum", "mean", "max" or "min"), or of what mpigrad.allreduce
    takes (numbers, numpy arrays, pytrees): a tensor comes back as a tensor
    of its dtype."""
    with communicator(group) as comm:
        if isinstance(value, ms.Tensor):
            return to_tensor(np.asarray(collectives.allreduce(to_numpy(value), op, comm=comm)))
        return collectives.allreduce(value, op, comm=comm)

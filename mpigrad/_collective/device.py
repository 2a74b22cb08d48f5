"""Device gradients summed where they lie, where MPI takes device memory
(CUDA- or ROCm-aware: mpigrad._comm.device_mpi): a Reducer's call of
contiguous float32 or float64 device arrays is packed on the device into one
bucket per dtype (a device copy per array), its producers' streams
synchronized once, each bucket summed in place by MPI (the group's route
"device memory through MPI": agreed, checked and watched as every call), the
mean applied on the device by the arrays' own library (``asarray`` of the
bucket, times the factor the host's mean uses), and unpacked: no copy
through host memory. Every other call of device arrays (half precision,
mixed with host arrays, skip, reproducible, a wire; or an MPI that is not
device-aware) is staged through host memory (mpigrad._base.arrays.Staging).
"""

from typing import Any, Dict, List, Sequence, cast

import numpy as np

from .._base import device
from .._base.arrays import detached, library_of, new_device_like
from .._base.description import array_item
from .._comm.device_mpi import DeviceSupport, device_support
from .._engine.settle import mean_factor
from .spec import Collective, Kind

__all__ = ["takes_device_path", "reduce_on_device", "device_support", "DeviceSupport"]

_SUMMED_ON_DEVICE = (np.dtype(np.float32), np.dtype(np.float64))


def takes_device_path(leaves: Sequence[Any]) -> bool:
    """Whether ``leaves`` are all device arrays this path sums (float32 or
    float64, of a library with ``asarray``) and MPI here is device-aware."""
    if not leaves or not all(device.is_device_array(detached(a)) for a in leaves):
        return False
    if not all(device.device_array(detached(a)).dtype in _SUMMED_ON_DEVICE for a in leaves):
        return False
    if not all(hasattr(library_of(a), "asarray") and hasattr(library_of(a), "empty_like")
               for a in leaves):
        return False
    return device_support().aware


def reduce_on_device(group: Any, leaves: Sequence[Any], inplace: bool, divisor: int,
                     structure: str) -> List[Any]:
    """The sum (``divisor`` 1) or mean of ``leaves`` across ``group``, in
    device memory: the arrays themselves where ``inplace``, else new ones."""
    memory = device.contiguous_arrays([detached(a) for a in leaves])
    runtime = device.runtime()
    places: Dict[np.dtype, List[int]] = {}
    for index, held in enumerate(memory):
        places.setdefault(held.dtype, []).append(index)
    sizes = {dtype: sum(memory[i].nbytes for i in members) for dtype, members in places.items()}
    buckets = device.kept(runtime, "device buckets", sizes,
                          lambda: {dtype: runtime.device_empty(nbytes).view(0, nbytes, dtype)
                                   for dtype, nbytes in sizes.items()})
    device.synchronize_producers(runtime, memory)
    offsets: Dict[int, int] = {}
    for dtype, members in places.items():
        at = 0
        for i in members:
            offsets[i] = at
            if memory[i].nbytes:
                runtime.copy(buckets[dtype].pointer + at, memory[i].pointer, memory[i].nbytes,
                             "pack")
            at += memory[i].nbytes
    support = device_support()
    group.run(Collective(
        Kind.ALLREDUCE, "reduce in device memory", tuple(cast(np.ndarray, buckets[d]) for d in places),
        op="sum",
        items=tuple(array_item(h.dtype, h.shape) for h in memory), structure=structure,
        settings=(("device memory", support.describe()),), noun="gradient"))
    if divisor != 1:
        library = library_of(leaves[0])
        for dtype, bucket in buckets.items():
            summed = library.asarray(bucket)
            summed *= mean_factor(dtype, divisor)
    outs = list(leaves) if inplace else [new_device_like(detached(a)) for a in leaves]
    for index, (out, held) in enumerate(zip(outs, memory)):
        if held.nbytes:
            target = device.device_array(detached(out)).pointer
            runtime.copy(target, buckets[held.dtype].pointer + offsets[index], held.nbytes,
                         "unpack")
    return outs

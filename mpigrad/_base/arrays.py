"""Array-kind adapter: numpy, torch, jax, cupy and other DLPack arrays in;
numpy views to reduce; results handed back as the caller's kind, on its device.

torch, jax and cupy are never imported here unless the caller passes their
arrays. CPU arrays are reduced through zero-copy numpy views; device arrays
(cupy, torch CUDA, jax on a GPU, any ``__cuda_array_interface__`` or DLPack
device array) are staged through host memory together (``Staging``): packed
into one device bucket, copied to one page-locked host buffer in one copy,
reduced there, copied back in one copy, unpacked on the device.
"""

import sys
from typing import Any, List, Optional, Sequence, Tuple, cast

import numpy as np

from . import device
from .array_lists import exactly_numpy
from .bfloat16 import bfloat16_dtype, is_bfloat16

__all__ = ["to_host", "from_host", "numpy_from_torch", "torch_from_numpy", "Staging",
           "detached", "new_device_like", "library_of"]

NUMPY, TORCH, JAX, CUPY, DLPACK = "numpy", "torch", "jax", "cupy", "dlpack"

#: per position, None (left as it was) or (array kind, whether the host array
#: is a staged copy of device memory, and for a device array its Staging)
Kinds = List[Optional[Tuple[Any, ...]]]

_ALIGN = 64          # bytes: each array's place in a staging buffer


class Staging:
    """The device arrays of one call, staged through host memory together:
    each contiguous array packed (a device copy) into one device bucket at
    an aligned offset, its producer's stream synchronized once, the bucket
    copied into one page-locked host buffer (one copy), whose views the
    reduction reads and writes; ``write_back`` copies the results back (one
    copy) and unpacks them on the device. The buffers are kept for the next
    call of the same sizes."""

    def __init__(self, arrays: Sequence[Any]) -> None:
        self.memory = device.contiguous_arrays(arrays)
        self.offsets, total = [], 0
        for memory in self.memory:
            self.offsets.append(total)
            total += -(-memory.nbytes // _ALIGN) * _ALIGN
        self.runtime = runtime = device.runtime()
        self.bucket, self.host = device.kept(
            runtime, "staging", total,
            lambda: (runtime.device_empty(total), runtime.host_empty(total)))
        device.synchronize_producers(runtime, self.memory)
        for memory, offset in zip(self.memory, self.offsets):
            if memory.nbytes:
                self.runtime.copy(self.bucket.pointer + offset, memory.pointer, memory.nbytes,
                                  "pack")
        if total:
            self.runtime.copy(self.host.ctypes.data, self.bucket.pointer, total, "stage")

    def view(self, index: int) -> np.ndarray:
        """The host array of device array ``index``."""
        memory, offset = self.memory[index], self.offsets[index]
        return self.host[offset:offset + memory.nbytes].view(memory.dtype).reshape(memory.shape)

    def write_back(self, results: Sequence[Tuple[int, np.ndarray, int]]) -> None:
        """Copy each (index, host result, device pointer) to the device: the
        results through their host views, the views' span in one copy, then
        each unpacked into its pointer (the gradient itself, or a new array)."""
        if not results:
            return
        for index, out, _ in results:
            view = self.view(index)
            if out.ctypes.data != view.ctypes.data:
                view[...] = out
        lo = min(self.offsets[i] for i, _, _ in results)
        hi = max(self.offsets[i] + self.memory[i].nbytes for i, _, _ in results)
        if hi > lo:
            self.runtime.copy(self.bucket.pointer + lo, self.host.ctypes.data + lo, hi - lo,
                              "unstage")
        for index, _, pointer in results:
            if self.memory[index].nbytes:
                self.runtime.copy(pointer, self.bucket.pointer + self.offsets[index],
                                  self.memory[index].nbytes, "unpack")


def _kind(grad: Any) -> Optional[str]:
    module = type(grad).__module__
    if module.startswith("torch"):
        return TORCH
    if module.startswith(("jax", "jaxlib")):
        return JAX
    if module.startswith("cupy"):
        return CUPY
    if hasattr(type(grad), "__dlpack__") or hasattr(type(grad), "__cuda_array_interface__"):
        return DLPACK
    return None


def numpy_from_torch(tensor: Any) -> np.ndarray:
    """A numpy view of a CPU torch tensor (bfloat16 as ml_dtypes' bfloat16)."""
    import torch
    if tensor.dtype == torch.bfloat16:
        bits: np.ndarray = tensor.view(torch.int16).numpy()
        return bits.view(bfloat16_dtype())
    array: np.ndarray = tensor.numpy()
    return array


def torch_from_numpy(array: np.ndarray) -> Any:
    """A CPU torch tensor viewing a numpy array (ml_dtypes' bfloat16 as torch's)."""
    import torch
    if is_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _refuse_tracer(grad: Any, index: int) -> None:
    """TypeError for a jax tracer: a collective cannot run inside a traced
    function (jax.jit, vmap, grad), whose arrays hold no values yet."""
    import jax
    if isinstance(grad, jax.core.Tracer):
        raise TypeError(f"grads[{index}]: expecting a jax array with values, got a jax tracer "
                        f"({type(grad).__name__}): a Reducer's calls run on values; inside "
                        "jax.jit use mpigrad.jax.reduce(grads, reducer) (or "
                        "mpigrad.jax.mean_gradients() in an optax chain)")


def to_host(grads: List[Any], inplace: bool) -> Tuple[List[Any], Optional[Kinds]]:
    """(host list, kinds): numpy views of every non-numpy array in ``grads``.

    ``kinds`` is None when nothing needed converting (the fast path), else a
    list with, per position, None (left as it was) or (kind, staged, ...) where
    ``staged`` says the host array is a copy of device memory (a device
    array's entry ends with its Staging and its place there).
    """
    if exactly_numpy(grads):
        return grads, None
    host, kinds = list(grads), cast(Kinds, [None] * len(grads))
    on_device = []
    for index, grad in enumerate(grads):
        if isinstance(grad, np.ndarray):
            if isinstance(grad, np.ma.MaskedArray):
                raise TypeError(f"grads[{index}]: a masked array's mask would be lost; pass "
                                "grad.filled(0) (or its .data) instead")
            continue                      # numpy, or a subclass of it: read as it is
        kind = _kind(grad)
        if kind is None:
            continue
        if kind == JAX:
            _refuse_tracer(grad, index)
            if inplace:
                raise TypeError(f"grads[{index}]: jax arrays are immutable, inplace=True "
                                "cannot write them; call reduce(grads) and use the "
                                "returned arrays")
        if device.is_device_array(detached(grad)):
            on_device.append(index)
        elif kind == TORCH:
            host[index] = numpy_from_torch(grad.detach())   # a view: a CPU tensor
            kinds[index] = (kind, False)
        elif kind == JAX:
            host[index] = np.asarray(grad)
            kinds[index] = (kind, False)
        else:
            try:
                host[index] = np.from_dlpack(grad)
            except (BufferError, RuntimeError, TypeError) as exc:
                raise TypeError(f"grads[{index}]: cannot read a {type(grad).__name__} "
                                f"through DLPack on the host ({exc})") from None
            kinds[index] = (kind, False)
    if on_device:
        staging = Staging([detached(grads[i]) for i in on_device])
        for place, index in enumerate(on_device):
            host[index] = staging.view(place)
            kinds[index] = (_kind(grads[index]), True, staging, place)
    return host, kinds


def detached(grad: Any) -> Any:
    """``grad`` without autograd history where it has one (torch's interface
    refuses a tensor that requires grad), else ``grad``."""
    detach = getattr(grad, "detach", None)
    return detach() if callable(detach) else grad


def library_of(array: Any) -> Any:
    """The module of ``array``'s library (cupy, torch, ...), where imported."""
    return sys.modules.get(type(array).__module__.split(".")[0])


def new_device_like(grad: Any) -> Any:
    """A new device array like ``grad``, made by its own library."""
    module = library_of(grad)
    empty_like = getattr(module, "empty_like", None)
    if empty_like is None:
        raise TypeError(f"cannot make a new {type(grad).__name__} for a result: its library "
                        "has no empty_like; pass inplace=True")
    return empty_like(grad)


def from_host(outs: List[Any], grads: List[Any], host: List[Any], kinds: Kinds,
              inplace: bool) -> List[Any]:
    """Hand results back as the caller's kinds: in place, the caller's own
    arrays (staged device arrays are written back); otherwise new arrays of
    the same kind on the same device. Untouched (skipped) positions get the
    caller's object back."""
    device_results: "dict[int, Tuple[Any, List[Tuple[int, np.ndarray, int]]]]" = {}
    for index, entry in enumerate(kinds):
        if entry is None:
            continue
        kind, staged = entry[0], entry[1]
        grad, out = grads[index], outs[index]
        if len(entry) == 4 and kind != JAX:          # a staged device array
            if out is host[index] and not inplace:
                outs[index] = grad
                continue
            target = grad if inplace else new_device_like(grad)
            staging, place = entry[2], entry[3]
            device_results.setdefault(id(staging), (staging, []))[1].append(
                (place, out, device.device_array(detached(target)).pointer))
            outs[index] = target
        elif out is host[index] and not (inplace and staged):
            outs[index] = grad
        elif kind == TORCH:
            outs[index] = grad if inplace else torch_from_numpy(out)
        elif kind == JAX:
            import jax
            outs[index] = jax.device_put(out, next(iter(grad.devices())))
        elif inplace:
            outs[index] = grad
    for staging, results in device_results.values():
        staging.write_back(results)
    return outs

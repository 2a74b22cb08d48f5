"""Array-kind adapter: numpy, torch, jax, cupy and other DLPack arrays in;
numpy views to reduce; results handed back as the caller's kind, on its device.

torch, jax and cupy are never imported here unless the caller passes their
arrays. CPU arrays are reduced through zero-copy numpy views; device arrays
(cupy, torch CUDA, jax on a GPU) are staged through host memory.
"""

from typing import Any, List, Optional, Tuple, cast

import numpy as np

from .bfloat16 import bfloat16_dtype, is_bfloat16

__all__ = ["to_host", "from_host", "numpy_from_torch", "torch_from_numpy"]

_NUMPY_ONLY = {np.ndarray}
NUMPY, TORCH, JAX, CUPY, DLPACK = "numpy", "torch", "jax", "cupy", "dlpack"

#: per position, None (left as it was) or (array kind, whether the host array
#: is a staged copy of device memory)
Kinds = List[Optional[Tuple[str, bool]]]


def _kind(grad: Any) -> Optional[str]:
    module = type(grad).__module__
    if module.startswith("torch"):
        return TORCH
    if module.startswith(("jax", "jaxlib")):
        return JAX
    if module.startswith("cupy"):
        return CUPY
    if hasattr(grad, "__dlpack__"):
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


def _torch_host(tensor: Any) -> Tuple[np.ndarray, bool]:
    """(numpy array, staged?): a view of a CPU tensor, a host copy of a device one."""
    tensor = tensor.detach()              # a view: never mpi4py's BufferError on leaves
    on_device = tensor.device.type != "cpu"
    return numpy_from_torch(tensor.cpu() if on_device else tensor), on_device


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
    list with, per position, None (left as it was) or (kind, staged) where
    ``staged`` says the host array is a copy of device memory.
    """
    if set(map(type, grads)) <= _NUMPY_ONLY:
        return grads, None
    host, kinds = list(grads), cast(Kinds, [None] * len(grads))
    for index, grad in enumerate(grads):
        if isinstance(grad, np.ndarray):
            if isinstance(grad, np.ma.MaskedArray):
                raise TypeError(f"grads[{index}]: a masked array's mask would be lost; pass "
                                "grad.filled(0) (or its .data) instead")
            continue                      # numpy, or a subclass of it: read as it is
        kind = _kind(grad)
        if kind is None:
            continue
        if kind == TORCH:
            host[index], staged = _torch_host(grad)
        elif kind == JAX:
            _refuse_tracer(grad, index)
            if inplace:
                raise TypeError(f"grads[{index}]: jax arrays are immutable, inplace=True "
                                "cannot write them; call reduce(grads) and use the "
                                "returned arrays")
            host[index], staged = np.asarray(grad), False
        elif kind == CUPY:
            host[index], staged = grad.get(), True
        else:
            try:
                host[index], staged = np.from_dlpack(grad), False
            except (BufferError, RuntimeError, TypeError) as exc:
                raise TypeError(f"grads[{index}]: cannot read a {type(grad).__name__} "
                                f"through DLPack on the host ({exc})") from None
        kinds[index] = (kind, staged)
    return host, kinds


def _torch_result(array: np.ndarray, like: Any) -> Any:
    tensor = torch_from_numpy(array)
    return tensor.to(like.device) if like.device.type != "cpu" else tensor


def from_host(outs: List[Any], grads: List[Any], host: List[Any], kinds: Kinds,
              inplace: bool) -> List[Any]:
    """Hand results back as the caller's kinds: in place, the caller's own
    arrays (staged device arrays are written back); otherwise new arrays of
    the same kind on the same device. Untouched (skipped) positions get the
    caller's object back."""
    for index, entry in enumerate(kinds):
        if entry is None:
            continue
        kind, staged = entry
        grad, out = grads[index], outs[index]
        if out is host[index] and not (inplace and staged):
            outs[index] = grad
        elif inplace:
            if staged and kind == CUPY:
                grad.set(out)
            elif staged:
                grad.detach().copy_(_torch_result(out, grad))
            outs[index] = grad
        elif kind == TORCH:
            outs[index] = _torch_result(out, grad)
        elif kind == JAX:
            import jax
            outs[index] = jax.device_put(out, next(iter(grad.devices())))
        elif kind == CUPY:
            import cupy
            with grad.device:
                outs[index] = cupy.asarray(out)
    return outs

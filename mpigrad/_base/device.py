"""Device memory as the reduction sees it: a device array's pointer, shape,
dtype and producer stream, read from ``__cuda_array_interface__`` (cupy, torch
CUDA tensors, numba, jax on a GPU) or DLPack (a device of type CUDA or ROCm);
device buckets and the copies between device and host memory; and the
runtime that makes them (the CUDA runtime, loaded on first use).

Tests run all of it on host memory exposed as device memory (as mpi4py's own
tests do): ``HostRuntime`` copies with memmove, and a CPU MPI reads the
"device" buffers it is handed. Every copy is counted in ``COPIES`` by what it
does: "pack" and "unpack" (device to device, in the device buckets),
"stage" (device to host) and "unstage" (host to device).
"""

import collections
import ctypes
import ctypes.util
import glob
import os
import sys
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple, \
    TypeVar

import numpy as np

__all__ = ["DeviceArray", "device_array", "is_device_array", "contiguous_arrays",
           "synchronize_producers", "kept", "DeviceBuffer", "Runtime", "HostRuntime",
           "CudaRuntime", "runtime", "set_runtime", "COPIES"]

#: the copies the device path made, by what each did (read by the tests and the bench)
COPIES: "collections.Counter[str]" = collections.Counter()

_DLPACK_DEVICES = {2: "cuda", 3: "cuda host", 10: "rocm", 13: "cuda managed"}
_ON_DEVICE = {2, 10, 13}


class DeviceArray(NamedTuple):
    """A device array's memory: where it is and what it holds."""

    pointer: int
    shape: Tuple[int, ...]
    dtype: np.dtype
    contiguous: bool
    stream: Optional[int]      # the producer's stream (None: the default stream)
    owner: Any                 # keeps the memory alive while it is used (a DLPack capsule)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _from_interface(obj: Any) -> DeviceArray:
    cai = obj.__cuda_array_interface__
    dtype = np.dtype(cai["typestr"])
    shape = tuple(int(d) for d in cai["shape"])
    strides = cai.get("strides")
    contiguous = _contiguous(shape, None if strides is None else tuple(strides), dtype.itemsize)
    stream = cai.get("stream")
    return DeviceArray(int(cai["data"][0]), shape, dtype, contiguous,
                       None if stream in (None, 1, 2) else int(stream), obj)


def _contiguous(shape: Tuple[int, ...], strides: Optional[Tuple[int, ...]],
                itemsize: int) -> bool:
    """Whether byte ``strides`` over ``shape`` lay the elements out in C order
    (an empty array's, and a dimension of extent 1's, do not matter)."""
    if strides is None or 0 in shape:
        return True
    step = itemsize
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent > 1 and stride != step:
            return False
        step *= extent
    return True


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DL_CODES = {0: "i", 1: "u", 2: "f", 5: "c"}      # kDLInt, kDLUInt, kDLFloat, kDLComplex
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object,
                                                                        ctypes.c_char_p]


def _from_dlpack(obj: Any) -> DeviceArray:
    capsule = obj.__dlpack__()
    tensor = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    code, bits = tensor.dtype.code, tensor.dtype.bits
    if code == 4 and bits == 16:                       # kDLBfloat
        from .bfloat16 import bfloat16_dtype
        dtype = bfloat16_dtype()
    elif code in _DL_CODES:
        dtype = np.dtype(f"{_DL_CODES[code]}{bits // 8}")
    else:
        raise TypeError(f"DLPack dtype code {code} ({bits} bits): expecting an integer, "
                        "floating or complex dtype")
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    strides = (None if not tensor.strides else
               tuple(tensor.strides[i] * dtype.itemsize for i in range(tensor.ndim)))
    contiguous = _contiguous(shape, strides, dtype.itemsize)
    return DeviceArray(int(tensor.data or 0) + int(tensor.byte_offset), shape, dtype,
                       contiguous, None, capsule)


def is_device_array(obj: Any) -> bool:
    """Whether ``obj`` lives in device memory (CUDA or ROCm)."""
    if hasattr(type(obj), "__cuda_array_interface__"):
        try:
            obj.__cuda_array_interface__
        except (AttributeError, RuntimeError, TypeError):   # torch CPU tensors raise
            return False
        return True
    dl_device = getattr(obj, "__dlpack_device__", None)
    if dl_device is None:
        return False
    try:
        return int(dl_device()[0]) in _ON_DEVICE
    except (TypeError, ValueError, RuntimeError, BufferError):
        return False


def device_array(obj: Any) -> DeviceArray:
    """The memory of the device array ``obj`` (``is_device_array``)."""
    if hasattr(type(obj), "__cuda_array_interface__"):
        return _from_interface(obj)
    return _from_dlpack(obj)


class DeviceBuffer:
    """A contiguous piece of device memory (a device bucket, or a view of one),
    exposed through ``__cuda_array_interface__``: MPI takes it as a buffer
    where it is device-aware, the arrays' own library as an array."""

    def __init__(self, pointer: int, size: int, dtype: Any, owner: Any = None) -> None:
        self.pointer, self.size, self.dtype, self.owner = pointer, size, np.dtype(dtype), owner

    @property
    def nbytes(self) -> int:
        return int(self.size * self.dtype.itemsize)

    @property
    def shape(self) -> Tuple[int, ...]:
        return (self.size,)

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        return {"shape": (self.size,), "typestr": self.dtype.str, "data": (self.pointer, False),
                "version": 3, "strides": None, "stream": None}

    def view(self, start: int, stop: int, dtype: Any = None) -> "DeviceBuffer":
        """Elements [start, stop) (as ``dtype``'s, where given: the same bytes)."""
        itemsize = self.dtype.itemsize
        new = np.dtype(dtype or self.dtype)
        return DeviceBuffer(self.pointer + start * itemsize,
                            (stop - start) * itemsize // new.itemsize, new, self)

    def reshape(self, *shape: Any) -> "DeviceBuffer":
        """Itself: it is 1-D (as a message's flat)."""
        return self


class Runtime(Protocol):
    """What the device path needs of a device runtime."""

    name: str

    def synchronize(self, stream: Optional[int]) -> None:
        """Wait for the work on ``stream`` (None: the default stream)."""

    def copy(self, dst: int, src: int, nbytes: int, what: str) -> None:
        """Copy ``nbytes`` between any two pointers (device or host), in order
        on the default stream; ``what`` counts it in COPIES."""

    def device_empty(self, nbytes: int) -> DeviceBuffer:
        """Device memory of ``nbytes`` (freed with the buffer)."""

    def host_empty(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory of ``nbytes`` (uint8), for staging."""


class HostRuntime:
    """Host memory standing in for device memory (tests; no GPU needed):
    copies are memmoves, streams have nothing to wait for (each
    synchronization counted)."""

    name = "host memory as device memory (tests)"

    def __init__(self) -> None:
        self.synchronized: "collections.Counter[Optional[int]]" = collections.Counter()

    def synchronize(self, stream: Optional[int]) -> None:
        self.synchronized[stream] += 1

    def copy(self, dst: int, src: int, nbytes: int, what: str) -> None:
        COPIES[what] += 1
        ctypes.memmove(dst, src, nbytes)

    def device_empty(self, nbytes: int) -> DeviceBuffer:
        memory = np.empty(max(nbytes, 1), np.uint8)
        return DeviceBuffer(memory.ctypes.data, nbytes, np.uint8, memory)

    def host_empty(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)


class CudaRuntime:
    """The CUDA runtime (libcudart, as torch's and cupy's wheels ship it),
    through ctypes: cudaMemcpy with unified addressing, cudaStreamSynchronize,
    cudaMalloc and cudaHostAlloc."""

    name = "CUDA runtime"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, args in (("cudaMemcpy", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                           ctypes.c_int]),
                           ("cudaStreamSynchronize", [ctypes.c_void_p]),
                           ("cudaMalloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]),
                           ("cudaFree", [ctypes.c_void_p]),
                           ("cudaHostAlloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                              ctypes.c_uint]),
                           ("cudaFreeHost", [ctypes.c_void_p])):
            function = getattr(lib, name)
            function.argtypes, function.restype = args, ctypes.c_int

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: CUDA error {status}")

    def synchronize(self, stream: Optional[int]) -> None:
        self._check(self.lib.cudaStreamSynchronize(stream or None), "cudaStreamSynchronize")

    def copy(self, dst: int, src: int, nbytes: int, what: str) -> None:
        COPIES[what] += 1
        self._check(self.lib.cudaMemcpy(dst, src, nbytes, 4), f"cudaMemcpy ({what})")  # Default

    def device_empty(self, nbytes: int) -> DeviceBuffer:
        pointer = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(pointer), max(nbytes, 1)), "cudaMalloc")
        return DeviceBuffer(int(pointer.value or 0), nbytes, np.uint8,
                            _Freed(self.lib.cudaFree, pointer))

    def host_empty(self, nbytes: int) -> np.ndarray:
        pointer = ctypes.c_void_p()
        self._check(self.lib.cudaHostAlloc(ctypes.byref(pointer), max(nbytes, 1), 0),
                    "cudaHostAlloc")
        memory = (ctypes.c_uint8 * max(nbytes, 1)).from_address(int(pointer.value or 0))
        array: np.ndarray = np.ctypeslib.as_array(memory)[:nbytes]
        _FREED[id(array)] = _Freed(self.lib.cudaFreeHost, pointer)
        return array


_FREED: Dict[int, Any] = {}


class _Freed:
    """Calls ``free(pointer)`` when collected."""

    def __init__(self, free: Any, pointer: ctypes.c_void_p) -> None:
        self.free, self.pointer = free, pointer

    def __del__(self) -> None:
        self.free(self.pointer)


def _cudart_candidates() -> List[str]:
    found = [ctypes.util.find_library("cudart") or ""]
    for base in sys.path:           # the nvidia-cuda-runtime wheel torch and cupy install
        found += glob.glob(os.path.join(base, "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
    return [path for path in found if path] + ["libcudart.so", "libcudart.so.12",
                                                "libcudart.so.11.0"]


_RUNTIME: List[Optional[Runtime]] = []


def runtime() -> Runtime:
    """The device runtime (the CUDA runtime, loaded at the first device array);
    RuntimeError naming what to install where none loads."""
    if not _RUNTIME:
        for path in _cudart_candidates():
            try:
                _RUNTIME.append(CudaRuntime(ctypes.CDLL(path)))
                break
            except (OSError, AttributeError):
                continue
        else:
            _RUNTIME.append(None)
    found = _RUNTIME[0]
    if found is None:
        raise RuntimeError("device arrays need the CUDA runtime (libcudart), which did not "
                           "load: install the CUDA toolkit or a torch/cupy CUDA wheel")
    return found


def set_runtime(new: Optional[Runtime]) -> None:
    """Use ``new`` as the device runtime (``HostRuntime()`` in tests); None
    loads the CUDA runtime again at the next use."""
    _RUNTIME.clear()
    if new is not None:
        _RUNTIME.append(new)


def contiguous_arrays(arrays: Sequence[Any]) -> List[DeviceArray]:
    """The DeviceArray of each of ``arrays``; TypeError naming the first that
    is not C-contiguous (its memory is read as one run of bytes)."""
    memory = [device_array(a) for a in arrays]
    for array, held in zip(arrays, memory):
        if not held.contiguous:
            raise TypeError(f"a device array ({type(array).__name__} of shape {held.shape}) "
                            "is not contiguous: expecting C-contiguous device gradients "
                            "(call .contiguous() or ascontiguousarray)")
    return memory


def synchronize_producers(runtime: "Runtime", memory: Sequence[DeviceArray]) -> None:
    """Wait once for each producer stream of ``memory`` (its data is then
    there to read)."""
    for stream in {held.stream for held in memory}:
        runtime.synchronize(stream)


_T = TypeVar("_T")
_KEPT: "weakref.WeakKeyDictionary[Any, Dict[str, Tuple[Any, Any]]]" = \
    weakref.WeakKeyDictionary()


def kept(runtime: "Runtime", purpose: str, key: Any, make: Callable[[], _T]) -> _T:
    """``make()``'s memory for ``purpose``, kept with ``runtime`` from call to
    call while ``key`` stays the same (fresh device or pinned memory would
    cost an allocation every call); a new key replaces it."""
    slots = _KEPT.setdefault(runtime, {})
    held = slots.get(purpose)
    if held is None or held[0] != key:
        held = slots[purpose] = (key, make())
    made: _T = held[1]
    return made

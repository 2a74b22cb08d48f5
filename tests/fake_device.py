"""Fake device arrays: host memory exposed as device memory, as mpi4py's own
tests do (test/arrayimpl.py), so that the device path runs without a GPU and
a CPU MPI reads the "device" buffers it is handed.

Three kinds, each with a library module of its own in sys.modules (what the
device path asks for new arrays and the mean: ``empty_like``, ``asarray``):

- ``fakecupy.ndarray``: ``__cuda_array_interface__`` v3 with a producer
  stream, as cupy's;
- ``faketorch.Tensor``: the interface with the legacy default stream and a
  ``detach()`` (a tensor that requires grad refuses its interface), as
  torch's CUDA tensors;
- ``fakedlpack.Array``: DLPack only, its device kCUDA (numpy's capsule with
  the device type rewritten).
"""

import ctypes
import sys
import types

import numpy as np


class _Held:
    """Host memory posing as device memory."""

    __array_priority__ = 100

    def __init__(self, data):
        self.data = np.ascontiguousarray(data)

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def size(self):
        return self.data.size

    def get(self):
        """The values, on the host (a copy)."""
        return self.data.copy()

    def __imul__(self, factor):
        self.data *= np.asarray(factor, self.data.dtype)
        return self


class CupyLike(_Held):
    """cupy's interface: ``__cuda_array_interface__`` with a producer stream."""

    stream = 7

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.data.shape, "typestr": self.data.dtype.str, "version": 3,
                "data": (self.data.ctypes.data, False), "strides": None,
                "stream": self.stream}


class TorchLike(_Held):
    """torch CUDA tensors' interface: the legacy default stream; refused on a
    tensor that requires grad (detach first)."""

    def __init__(self, data, requires_grad=False):
        super().__init__(data)
        self.requires_grad = requires_grad

    def detach(self):
        out = TorchLike.__new__(TorchLike)
        out.data, out.requires_grad = self.data, False
        return out

    @property
    def __cuda_array_interface__(self):
        if self.requires_grad:
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires "
                               "grad. If gradients aren't required, use var.detach()")
        return {"shape": self.data.shape, "typestr": self.data.dtype.str, "version": 2,
                "data": (self.data.ctypes.data, False), "strides": None}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensorHead(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice)]


_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_pointer.restype, _pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


class DLPackLike(_Held):
    """DLPack only, on "CUDA device 0"."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None, **kwargs):
        capsule = self.data.__dlpack__()
        head = _DLTensorHead.from_address(_pointer(capsule, b"dltensor"))
        head.device.device_type = 2                 # kDLCUDA
        return capsule


def _module(name, kind):
    module = types.ModuleType(name)
    kind.__module__ = name
    module.ndarray = kind
    module.asarray = lambda obj: kind(_wrap(obj))
    module.empty_like = lambda a: kind(np.empty_like(a.data))
    return module


def _wrap(obj):
    """A numpy array over a device buffer's memory (no copy)."""
    if isinstance(obj, _Held):
        return obj.data
    cai = obj.__cuda_array_interface__
    dtype = np.dtype(cai["typestr"])
    count = int(np.prod(cai["shape"]))
    memory = (ctypes.c_byte * (count * dtype.itemsize)).from_address(cai["data"][0])
    return np.frombuffer(memory, dtype).reshape(cai["shape"])


LIBRARIES = {"fakecupy": CupyLike, "faketorch": TorchLike, "fakedlpack": DLPackLike}
for _name, _kind in LIBRARIES.items():
    sys.modules[_name] = _module(_name, _kind)


def make(kind, data):
    """A fake device array of ``kind`` ("fakecupy", ...) holding ``data``."""
    return LIBRARIES[kind](data)


def values(array):
    """The values of a fake device array (or a numpy one), on the host."""
    return array.get() if isinstance(array, _Held) else np.asarray(array)

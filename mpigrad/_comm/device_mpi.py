"""Whether the MPI library takes device memory (CUDA-aware, ROCm-aware), asked
of the library itself: Open MPI's ``MPIX_Query_cuda_support()`` and
``MPIX_Query_rocm_support()``, MPICH's ``MPIX_GPU_query_support`` (and its
``MPIX_Query_cuda_support``), Cray MPICH's ``MPICH_GPU_SUPPORT_ENABLED``;
looked up in the library mpi4py is linked to, after MPI_Init (each answers
for the runtime as launched). ``MPIGRAD_DEVICE_MPI=1`` or ``0`` overrides the
answer (a library the queries do not know, or to force staging); mpi4py
itself exposes none of them.
"""

import ctypes
import functools
import os
from typing import List, NamedTuple, Optional

from mpi4py import MPI

__all__ = ["DeviceSupport", "device_support", "OVERRIDE"]

#: the switch that overrides what the library says
OVERRIDE = "MPIGRAD_DEVICE_MPI"
_MPICH_GPU = {"cuda": 0, "hip": 2}        # mpi.h: MPIX_GPU_SUPPORT_CUDA, _ZE (1), _HIP


class DeviceSupport(NamedTuple):
    """Which device memory MPI's calls take, and how that was found out."""

    cuda: bool
    rocm: bool
    how: str

    @property
    def aware(self) -> bool:
        """Whether device buffers go to MPI as they are."""
        return self.cuda or self.rocm

    def describe(self) -> str:
        kinds = [k for k, on in (("CUDA", self.cuda), ("ROCm", self.rocm)) if on]
        return (f"{' and '.join(kinds)}-aware" if kinds else "not device-aware") + \
            f" ({self.how})"

    def route(self) -> str:
        """One line: where device arrays' sums run under this library."""
        where = ("summed in device memory by MPI" if self.aware else
                 "staged through host memory (one transfer each way per call)")
        return f"device arrays: {where}; MPI {self.describe()}"


def _libraries() -> List[str]:
    """The MPI libraries loaded in this process (mpi4py's, once MPI is imported)."""
    try:
        with open("/proc/self/maps") as maps:
            found = {line.split()[-1] for line in maps if "libmpi" in line and ".so" in line}
    except OSError:
        found = set()
    return sorted(found)


def _ask(lib: ctypes.CDLL, name: str) -> Optional[bool]:
    function = getattr(lib, name, None)
    if function is None:
        return None
    function.restype, function.argtypes = ctypes.c_int, []
    return bool(function())


def _ask_mpich(lib: ctypes.CDLL, kind: str) -> Optional[bool]:
    function = getattr(lib, "MPIX_GPU_query_support", None)
    if function is None:
        return None
    flag = ctypes.c_int(0)
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    if function(_MPICH_GPU[kind], ctypes.byref(flag)) != 0:
        return None
    return bool(flag.value)


@functools.lru_cache(maxsize=None)
def _queried() -> DeviceSupport:
    """The library's own answer (MPI initialised first)."""
    if not MPI.Is_initialized():
        MPI.Init_thread()
    cuda = rocm = None
    asked = []
    for path in _libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        mpich_cuda, mpich_hip = _ask_mpich(lib, "cuda"), _ask_mpich(lib, "hip")
        if mpich_cuda is not None:
            cuda, rocm = mpich_cuda, mpich_hip
            asked.append("MPIX_GPU_query_support")
            break
        cuda, rocm = _ask(lib, "MPIX_Query_cuda_support"), _ask(lib, "MPIX_Query_rocm_support")
        asked += [n for n, got in (("MPIX_Query_cuda_support", cuda),
                                   ("MPIX_Query_rocm_support", rocm)) if got is not None]
        if cuda is not None or rocm is not None:
            break
    if os.environ.get("MPICH_GPU_SUPPORT_ENABLED") == "1" and not (cuda or rocm):
        return DeviceSupport(True, False, "Cray MPICH: MPICH_GPU_SUPPORT_ENABLED=1")
    if not asked:
        return DeviceSupport(False, False, "the MPI library has no device-support query")
    return DeviceSupport(bool(cuda), bool(rocm), f"the MPI library's {' and '.join(asked)}")


def device_support() -> DeviceSupport:
    """This rank's MPI and device memory: ``MPIGRAD_DEVICE_MPI`` where set
    (1: CUDA-aware, 0: not), else the library's own queries."""
    forced = os.environ.get(OVERRIDE, "").strip()
    if forced in ("0", "1"):
        return DeviceSupport(forced == "1", False, f"{OVERRIDE}={forced}")
    if forced:
        raise ValueError(f"{OVERRIDE}: expecting 0 or 1, got {forced!r}; unset it to ask the "
                         "MPI library")
    return _queried()

"""mpigrad's C kernels (``kernels.c``), compiled on this machine at their first
use with its C compiler for its own CPU (``-O3 -march=native``: the compiler
vectorises them at the vector units' width) and kept in mpigrad's cache
directory, one library per source, compiler and CPU, so every later process
loads it in a millisecond. Where no compiler works, ``library()`` is None and
the callers keep their numba kernels (the same bits, slower);
``MPIGRAD_KERNELS=numba`` asks for those, ``MPIGRAD_KERNELS=portable`` for the C
kernels built without the CPU's own extensions (the same bits). ``kernels_name()`` says which run
(the bench prints it).
"""

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import os
import platform
import shlex
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

__all__ = ["library", "kernels_name", "cache_directory", "compiler", "host_call", "extension"]

_SOURCE = Path(__file__).with_name("kernels.c")
_L = TypeVar("_L")
#: IEEE single precision as numpy computes it: no contraction into FMAs, no fast-math
#: (-fno-trapping-math only lets the compiler evaluate both sides of a select: no
#: value changes, and nothing here reads the floating-point exception flags)
_COMMON = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno",
           "-fno-trapping-math"]
_BUILDS: Tuple[Tuple[str, List[str]], ...] = (("native", ["-march=native", "-mprefer-vector-width=512"]),
           ("native", ["-march=native"]), ("portable", []))
_SIGNATURES = {
    "f16_to_f32": ("p", "p", "n"), "f32_to_f16": ("p", "p", "n"),
    "f32_to_bf16": ("p", "p", "n"), "bf16_to_f32": ("p", "p", "n"),
    "add_f16": ("p", "p", "n"), "add_bf16": ("p", "p", "n"),
    "fused_sum": ("p", "n", "n", "p", "i", "i", "i", "f", "i", "f", "i"),
    "exact_exponents_f32": ("p", "n", "n", "p"),
    "exact_limbs_f32": ("p", "n", "n", "p", "p"),
    "exact_round_odd_f32": ("p", "n", "n", "n", "p", "i", "p", "i", "p"),
    "exact_mode_enter": (), "exact_mode_leave": ("i",),
    "exact_sum_f32": ("p", "n", "n", "i", "p", "p"),
    "exact_sum_half": ("p", "n", "n", "i", "i", "p", "p"),
}
_RESULTS = {"fused_sum": ctypes.c_int64, "exact_round_odd_f32": ctypes.c_int64,
            "exact_sum_f32": ctypes.c_int64, "exact_sum_half": ctypes.c_int64,
            "exact_mode_enter": ctypes.c_int64}
_CTYPES = {"p": ctypes.c_void_p, "n": ctypes.c_size_t, "f": ctypes.c_float,
           "i": ctypes.c_int64}


def cache_directory() -> Path:
    """Where built kernels are kept: ``MPIGRAD_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/mpigrad`` (``~/.cache/mpigrad``)."""
    given = os.environ.get("MPIGRAD_CACHE_DIR")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mpigrad"


def _cpu() -> str:
    """This CPU's model and feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def compiler() -> List[str]:
    """The C compiler the kernels are built with: ``CC``, else the one that
    built this Python, else ``cc`` (its words)."""
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def _build(source: Path, target: Path, flags: List[str]) -> Optional[str]:
    """Compile ``source`` into ``target`` (atomically: ranks may build at once);
    None, or why it failed."""
    try:
        handle, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(handle)
    except OSError as error:            # (a cache directory that cannot be written)
        return f"the cache directory {target.parent}: {error}"
    try:
        done = subprocess.run([*compiler(), *_COMMON, *flags, str(source), "-o", scratch],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else \
                f"the compiler exited with {done.returncode}"
        os.replace(scratch, target)
        return None
    except (OSError, subprocess.SubprocessError) as error:
        return str(error)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def _build_once(source: Path, target: Path, flags: List[str]) -> Optional[str]:
    """Build ``target`` unless another process has meanwhile: under a lock file
    beside it one process compiles and the others (a node's ranks at their
    first use) wait and load what it built, instead of each compiling the same
    library at once. None, or why the build failed; where the file system has
    no locks, each builds its own (atomically, as before)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(target.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as error:            # (a cache directory that cannot be written)
        return f"the cache directory {target.parent}: {error}"
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_EX)      # released when closed (or its process ends)
        return None if target.exists() else _build(source, target, flags)
    finally:
        os.close(lock)


def _built(source: Path, builds: Sequence[Tuple[str, List[str]]],
           load: Callable[[Path], _L]) -> Tuple[Optional[Tuple[Path, _L]], str]:
    """((the library's path, the library), how it was built) of the first of ``builds``
    ((name, flags)) of ``source`` that compiles and loads (``load``: how), kept in the
    cache directory per source, compiler, flags and CPU; else (None, why none did)."""
    try:
        text = source.read_text()
    except OSError as error:                  # (a package without its sources)
        return None, str(error)
    problems = []
    for name, flags in builds:
        key = hashlib.sha256("\0".join([text, *compiler(), *_COMMON, *flags,
                                        _cpu()]).encode()).hexdigest()[:16]
        target = cache_directory() / f"{source.stem}-{name}-{key}.so"
        problem = None if target.exists() else _build_once(source, target, flags)
        if problem is None:
            try:
                return (target, load(target)), \
                    f"{name}: {' '.join(flags) or 'the compiler defaults'}"
            except (OSError, ImportError) as error:
                problem = str(error)
        problems.append(f"{name}: {problem}")
    return None, "; ".join(problems)


def _kernels_asked() -> str:
    """MPIGRAD_KERNELS, lower case ("" where unset)."""
    return os.environ.get("MPIGRAD_KERNELS", "").lower()


def _library(path: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(path))


@functools.lru_cache(maxsize=None)
def _loaded() -> Tuple[Optional[ctypes.CDLL], str]:
    """The library and its name, or None and why the numba kernels run."""
    asked = _kernels_asked()
    if asked == "numba":
        return None, "numba (MPIGRAD_KERNELS=numba)"
    built, how = _built(_SOURCE, [b for b in _BUILDS if asked != "portable" or b[0] == "portable"],
                        _library)
    if built is None:
        return None, f"numba (no C kernels: {how})"
    lib = built[1]
    for function, args in _SIGNATURES.items():
        getattr(lib, function).argtypes = [_CTYPES[a] for a in args]
        getattr(lib, function).restype = _RESULTS.get(function)
    return lib, f"C ({how})"


def library() -> Optional[ctypes.CDLL]:
    """The compiled kernels (built at the first call on this machine), or None."""
    return _loaded()[0]


def kernels_name() -> str:
    """Which kernels cast and sum half precision here, and why."""
    return _loaded()[1]


@functools.lru_cache(maxsize=None)
def host_call() -> Tuple[Optional[Tuple[str, ctypes.CDLL]], str]:
    """((its path, the library), how it was built) of ``host_call.c``, the trampoline
    through which a compiled step (MindSpore's aot Custom op) hands its own buffers to
    Python; (None, why not) where no compiler works (then a host call copies)."""
    built, how = _built(_SOURCE.with_name("host_call.c"), [("portable", [])], _library)
    return (None if built is None else (str(built[0]), built[1])), how


@functools.lru_cache(maxsize=None)
def extension(stem: str) -> Tuple[Optional[ModuleType], str]:
    """(the CPython extension module ``mpigrad_<stem>``, how it was built) of
    ``<stem>.c`` beside this file, built at its first use against this Python's and this
    numpy's headers (their versions in its flags: another interpreter or numpy builds
    its own); (None, why not) where no compiler works or ``MPIGRAD_KERNELS=numba`` asks
    for no C (its callers then take numpy's way)."""
    if _kernels_asked() == "numba":
        return None, "numpy (MPIGRAD_KERNELS=numba)"
    import numpy
    headers = [f"-I{sysconfig.get_paths()['include']}", f"-I{numpy.get_include()}",
               f"-DMPIGRAD_PYTHON={platform.python_version()}",
               f"-DMPIGRAD_NUMPY={numpy.__version__}"]
    name = f"mpigrad_{stem}"

    def load(path: Path) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} is no extension module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    built, how = _built(_SOURCE.with_name(f"{stem}.c"), [("portable", headers)], load)
    return (None if built is None else built[1]), how

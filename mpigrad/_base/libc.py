"""The C library as ctypes sees it: one handle, errno kept, for the functions
mpigrad calls directly (the cross-memory moves, the node's shared mappings,
madvise). Each caller sets its own functions' signatures."""

import ctypes

__all__ = ["LIBC"]

#: the process's own symbols (on Linux, libc's)
LIBC = ctypes.CDLL(None, use_errno=True)

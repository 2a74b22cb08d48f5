"""Horovod's API on mpigrad: change ``import horovod.torch as hvd`` to
``import mpigrad.horovod.torch as hvd``, and ``import horovod`` (for
``horovod.run``) to ``import mpigrad.horovod as horovod`` (see docs/horovod.md)."""

from typing import Any

__all__ = ["run"]


def __getattr__(name: str) -> Any:
    """``run`` on first use: importing mpigrad.horovod does not start MPI."""
    if name == "run":
        from .launch import run
        return run
    raise AttributeError(f"module 'mpigrad.horovod' has no attribute {name!r}")

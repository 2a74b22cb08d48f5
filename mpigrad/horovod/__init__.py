"""Horovod's API on mpigrad: change ``import horovod.torch as hvd`` to
``import mpigrad.horovod.torch as hvd`` (see docs/horovod.md)."""

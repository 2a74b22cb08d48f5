#!/usr/bin/env bash
# Single node, the MPICH wheel from PyPI: `python -m mpi4py` turns an uncaught
# exception on any rank into MPI_Abort, so the job ends instead of hanging.
set -euo pipefail
NP=${NP:-2}
timeout -k 10 600 mpiexec -n "$NP" python -m mpi4py examples/numpy_sgd.py
timeout -k 10 600 mpiexec -n "$NP" python -m mpi4py -m mpigrad.bench --layout resnet50

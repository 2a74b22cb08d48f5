#!/usr/bin/env bash
# The benchmark at both MPI thread levels that matter to MPICH: 'multiple'
# (mpi4py's default) and 'serialized'. The level is fixed at MPI_Init, so each
# runs as its own job. Extra arguments go to mpigrad-bench.
set -euo pipefail
NP=${NP:-2}
for level in multiple serialized; do
    MPI4PY_RC_THREAD_LEVEL=$level timeout -k 10 900 mpiexec -n "$NP" python -m mpi4py -m mpigrad.bench "$@"
done

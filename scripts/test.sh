#!/usr/bin/env bash
# Run the whole test suite: serial tests, then the collective tests on 2 and 3
# ranks. Every MPI step runs under `python -m mpi4py` (a failing rank aborts
# the job) and a hard timeout, so nothing can hang.
# Needs mpigrad installed with its test extra: pip install -e '.[mpich,test]'
set -euo pipefail
cd "$(dirname "$0")/.."
MPI_STEP_TIMEOUT=${MPI_STEP_TIMEOUT:-900}
PYTEST_ARGS=(-p no:cacheprovider -q -rfEs)

echo "== serial tests (1 process)"
python -m pytest "${PYTEST_ARGS[@]}" -m "not mpi" tests

for n in 2 3; do
    echo "== collective tests on $n ranks"
    timeout -k 10 "$MPI_STEP_TIMEOUT" \
        mpiexec -n "$n" python -m mpi4py -m pytest "${PYTEST_ARGS[@]}" --with-mpi -x -m mpi tests
done

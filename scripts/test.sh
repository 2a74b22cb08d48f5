#!/usr/bin/env bash
# Run the whole test suite: serial tests, then the collective tests on 2 and 3
# ranks. Nothing can hang: every MPI step runs under `python -m mpi4py` (a rank
# that raises aborts the job), mpigrad's watchdog (MPIGRAD_TIMEOUT: a stalled
# collective aborts the job with a diagnostic naming it), pytest-timeout's
# thread method (a test past its limit dumps its stacks and ends the job) and a
# hard `timeout` on the whole step.
# The Slurm templates run on a one-node Slurm in between (scripts/test_slurm.sh).
# Needs mpigrad installed with its extras: pip install -e '.[mpich,test,examples]'
set -euo pipefail
cd "$(dirname "$0")/.."
MPI_STEP_TIMEOUT=${MPI_STEP_TIMEOUT:-900}
export MPIGRAD_TIMEOUT=${MPIGRAD_TIMEOUT:-60}
PYTEST_ARGS=(-p no:cacheprovider -q -rfEs --capture=sys)

echo "== serial tests (1 process)"
python -m pytest "${PYTEST_ARGS[@]}" -m "not mpi" tests

echo "== Slurm batch templates on a one-node Slurm (root and apt-get; skipped elsewhere)"
bash scripts/test_slurm.sh

for n in 2 3; do
    echo "== collective tests on $n ranks"
    timeout -k 10 "$MPI_STEP_TIMEOUT" \
        mpiexec -n "$n" python -m mpi4py -m pytest "${PYTEST_ARGS[@]}" --with-mpi -x -m mpi tests
done

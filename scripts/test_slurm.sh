#!/usr/bin/env bash
# The Slurm batch templates, run for real on a one-node Slurm on this machine
# (127.0.0.1, 2 CPUs): installs Debian's slurmctld, slurmd, slurm-client and
# munge where missing (apt-get, as root), starts munged, slurmctld and slurmd
# with a private configuration, submits both templates (scaled down) with
# sbatch (and, where the test command made .venv-mindspore, MindSpore's
# TrainOneStepCell example under srun), checks what they printed, stops what it started, and prints
# "N passed, N failed". Without root or apt-get it says so and exits 0, or 1 in
# CI (CI=true). Needs mpigrad installed with the mpich and examples extras.
set -uo pipefail
cd "$(dirname "$0")/.."
passed=0 failed=0
LIMIT=${SLURM_TEST_TIMEOUT:-300}

unavailable() {
    echo "test_slurm: $1; the Slurm templates were not run"
    if [ "${CI:-}" = true ]; then exit 1; fi
    exit 0
}

if [ "$(id -u)" != 0 ]; then unavailable "not root (daemons and apt-get need it)"; fi
if ! command -v sbatch >/dev/null || ! command -v slurmctld >/dev/null \
        || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || unavailable "no apt-get to install Slurm with"
    echo "== installing slurmctld slurmd slurm-client munge"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        slurmctld slurmd slurm-client munge >/dev/null || unavailable "apt-get install failed"
fi

dir=$(mktemp -d)
host=$(hostname -s)
mkdir -p "$dir/state" "$dir/spool" /run/munge
cat > "$dir/slurm.conf" <<CONF
ClusterName=mpigrad
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
NodeName=$host NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$dir/slurm.conf
started_munge=
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || create-munge-key -f; }
    chown -R munge:munge /run/munge /etc/munge 2>/dev/null
    runuser -u munge -- /usr/sbin/munged 2>/dev/null || /usr/sbin/munged --force
    started_munge=yes
fi
slurmctld -f "$SLURM_CONF" && slurmd -f "$SLURM_CONF" || unavailable "the Slurm daemons did not start"

stop() {
    scontrol shutdown >/dev/null 2>&1
    for pid in "$dir/slurmd.pid" "$dir/slurmctld.pid"; do
        [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null
    done
    [ -n "$started_munge" ] && pkill -x munged
    for _ in $(seq 10); do
        pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || break
        sleep 0.5
    done
    rm -rf "$dir"
}
trap stop EXIT

for _ in $(seq 30); do
    sinfo -h -o %t 2>/dev/null | grep -q idle && break
    sleep 1
done

check() {   # name, expected text, command...
    local name=$1 want=$2 out
    shift 2
    out=$(timeout -k 10 "$LIMIT" "$@" 2>&1)
    if grep -q -- "$want" <<<"$out"; then
        echo "PASSED $name"
        passed=$((passed + 1))
    else
        echo "FAILED $name: expected '$want' in:"
        echo "$out" | tail -20
        failed=$((failed + 1))
    fi
}

submit() {  # sbatch a template and print its output once it ends
    # (polled every 0.2 s: sbatch --wait polls every 10 s or so, a third of this step)
    local out=$dir/job-$RANDOM.out id
    id=$(sbatch --parsable --output="$out" "$@") || return
    while [ -n "$(squeue -h -j "$id" 2>/dev/null)" ]; do sleep 0.2; done
    cat "$out"
}

echo "== Slurm: $(sinfo -h -o '%P %t %c CPUs' | head -1)"
check "benchmark template (mpiexec in the allocation)" "result verified on every rank: yes" \
    env BENCH_LAYOUT=small BENCH_REPEATS=2 bash -c "$(declare -f submit); dir=$dir; submit scripts/slurm_example.sbatch"
check "training template (mpiexec in the allocation)" "claims hold: True" \
    bash -c "$(declare -f submit); dir=$dir; submit scripts/slurm_train.sbatch"
check "training template (srun --mpi=pmi2)" "claims hold: True" \
    env LAUNCH=srun bash -c "$(declare -f submit); dir=$dir; submit scripts/slurm_train.sbatch"
if [ "${MPIGRAD_TEST_MINDSPORE:-1}" = 1 ] && [ -x .venv-mindspore/bin/python ]; then
    # MindSpore's data parallelism on MPI's ranks under srun: no msrun, scheduler or init()
    check "MindSpore's TrainOneStepCell example (srun --mpi=pmi2)" "claims hold: True" \
        env LAUNCH=srun TRAIN_SCRIPT=examples/mindspore/train_one_step.py \
        PATH="$PWD/.venv-mindspore/bin:$PATH" \
        bash -c "$(declare -f submit); dir=$dir; submit scripts/slurm_train.sbatch"
fi
check "plain srun -n 2 warns on every process" "2 warnings" bash -c \
    "srun -n 2 python -c 'import mpigrad; mpigrad.Reducer()' 2>&1 | grep -c 'srun --mpi=pmi2' | sed 's/\$/ warnings/'"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]

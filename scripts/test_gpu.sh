#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA, cupy, torch and jax but no package
# index: the collective GPU tests (cupy, torch CUDA, jax GPU arrays) at 2 and 3
# ranks, then staging costs of ResNet-50's gradients as cupy arrays through the
# bench's own layout. MPICH, mpi4py, optree and pytest-mpi come as wheels in
# .whl/ when not installed (see docs/testing.md); results go to
# $OUT (or ./gpu-out) as log files. Where no GPU is present it says so and
# exits 77 (nothing checked: neither a pass nor a failure).
set -uo pipefail
cd "$(dirname "$0")/.."
if ! nvidia-smi -L > /dev/null 2>&1; then
    echo "test_gpu.sh: no GPU here (nvidia-smi finds none): nothing checked. The device" \
         "path is tested on fake device arrays by tests/test_device_mpi.py in the test command."
    exit 77
fi
out=${OUT:-gpu-out}
mkdir -p "$out"
py=$(command -v python3)     # the machine's python (cupy, torch, jax), for every rank too
prefix=/tmp/mpigrad-mpi
if [ -d .whl ]; then
    "$py" -m pip install -q --no-index --no-deps --prefix "$prefix" .whl/*.whl
    site=$("$py" -c 'import sys; print(f"lib/python{sys.version_info[0]}.{sys.version_info[1]}")')
    export PATH="$prefix/bin:$PATH" PYTHONPATH="$prefix/$site/site-packages"
    export MPI4PY_LIBMPI="$prefix/lib/libmpi.so.12" LD_LIBRARY_PATH="$prefix/lib:${LD_LIBRARY_PATH:-}"
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} MPIGRAD_TIMEOUT=60 PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/gpu.log"
"$py" - <<'EOF' 2>&1 | tee -a "$out/gpu.log"
from mpi4py import MPI
import cupy, torch, jax
from mpigrad._comm.device_mpi import device_support
print(MPI.Get_library_version().splitlines()[0], "| cupy", cupy.__version__,
      "| torch", torch.__version__, "| jax", jax.__version__, jax.devices())
print(device_support().route())
EOF
status=0
for n in 2 3; do
    echo "== GPU tests on $n ranks" | tee -a "$out/gpu.log"
    timeout -k 10 300 mpiexec -n "$n" "$py" -m mpi4py -m pytest -p no:cacheprovider -q \
        -rfEs --with-mpi -m gpu tests 2>&1 | tee -a "$out/gpu.log" || status=1
    timeout -k 10 300 mpiexec -n "$n" "$py" -m mpi4py -m pytest -p no:cacheprovider -q \
        -rfEs --with-mpi tests/test_device_mpi.py 2>&1 | tee -a "$out/gpu.log" || status=1
done
echo "== staging ResNet-50 cupy gradients, 2 ranks" | tee -a "$out/gpu.log"
timeout -k 10 240 mpiexec -n 2 "$py" -m mpi4py scripts/gpu_staging.py 2>&1 \
    | tee -a "$out/gpu.log" || status=1
exit $status

#!/usr/bin/env bash
# The device check for a machine with an NVIDIA GPU and a package index: a fresh
# environment with mpigrad (MPICH wheel), CuPy for the CUDA the driver reports and torch's
# CUDA build, then scripts/test_gpu.sh (the GPU tests at 2 and 3 ranks sharing the
# devices, the fake-device tests, ResNet-50's cupy gradients timed against numpy's).
# One summary line last. Where no GPU is present it says "no GPU here" and exits 77
# (nothing checked: neither a pass nor a failure). Logs in $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
if ! nvidia-smi -L > /dev/null 2>&1; then
    echo "gpu_check: no GPU here (nvidia-smi finds none): nothing checked; the device path" \
         "is tested on fake device arrays only (tests/test_device_mpi.py)"
    exit 77
fi
cuda=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\)\..*/\1/p' | head -1)
venv=${GPU_VENV:-.venv-gpu}
python3 -m venv "$venv" && . "$venv/bin/activate" \
    && python -m pip install -q -e '.[mpich,test]' "cupy-cuda${cuda:-12}x" torch \
    || { echo "gpu_check: FAILED: the install (CUDA ${cuda:-unknown})"; exit 1; }
start=$SECONDS
bash scripts/test_gpu.sh
status=$?
log=${OUT:-gpu-out}/gpu.log
echo "gpu_check: $( [ $status = 0 ] && echo passed || echo FAILED ) in $((SECONDS - start)) s" \
     "on $(nvidia-smi -L | wc -l) GPU(s), CUDA $cuda;" \
     "$(grep -E '^[0-9]+ (passed|failed)' "$log" 2>/dev/null | tr '\n' ';')" \
     "$(grep -m1 '^device arrays:' "$log" 2>/dev/null)"
exit $status

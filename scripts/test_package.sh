#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel (python -m
# build), check their metadata (twine check), install the wheel with the MPICH
# extra into a fresh virtual environment, and run a 2-rank smoke test from a
# directory outside the checkout (so that a file missing from the package
# fails here): a reduction against its reference, and the benchmark on its
# smallest layout (its layout files are package data).
# Needs: python with pip; build and twine are installed if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip install -q build twine
python -m build --outdir "$work/dist" . > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
python -m twine check --strict "$work"/dist/*
python -m venv "$work/venv"
wheel=$(ls "$work"/dist/mpigrad-*.whl)
"$work/venv/bin/python" -m pip install -q "${wheel}[mpich]"
cd "$work"               # outside the checkout: only the installed package is importable
cat > smoke.py <<'PY'
import numpy as np
from mpi4py import MPI
import mpigrad
rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
with mpigrad.Reducer() as reducer:
    grads = {"w": np.full((3, 4), rank + 1.0, np.float32), "b": np.arange(5, dtype=np.float16)}
    out = reducer.reduce(grads)
assert mpigrad.__file__.startswith(__import__("sys").prefix), mpigrad.__file__
assert np.array_equal(out["w"], np.full((3, 4), (size + 1) / 2, np.float32)), out["w"]
assert out["b"].dtype == np.float16 and np.array_equal(out["b"], np.arange(5, dtype=np.float16))
if rank == 0:
    print(f"smoke: mpigrad {mpigrad.__version__} from {mpigrad.__file__}: reduce on {size} ranks ok")
PY
PATH="$work/venv/bin:$PATH" timeout -k 10 300 mpiexec -n 2 python -m mpi4py smoke.py
# the C kernels (kernels.c is package data) build from the wheel; with no compiler
# (CC=false) the numba kernels run instead, and the smoke test still passes
kernels='from mpigrad._base import native; print("kernels:", native.kernels_name())'
MPIGRAD_CACHE_DIR="$work/kernels" "$work/venv/bin/python" -c "$kernels" | tee "$work/kernels.txt"
grep -q "kernels: C" "$work/kernels.txt"
# the compiled step's trampoline (host_call.c, package data too) builds the same way
trampoline='from mpigrad._base import native; built, how = native.host_call()
print("host call:", "built" if built else "none", how)'
MPIGRAD_CACHE_DIR="$work/kernels" "$work/venv/bin/python" -c "$trampoline" | tee "$work/host_call.txt"
grep -q "host call: built" "$work/host_call.txt"
# and the list kernels (array_lists.c, a CPython extension, package data too)
lists='from mpigrad._base import native; built, how = native.extension("array_lists")
print("array lists:", "built" if built else "none", how)'
MPIGRAD_CACHE_DIR="$work/kernels" "$work/venv/bin/python" -c "$lists" | tee "$work/lists.txt"
grep -q "array lists: built" "$work/lists.txt"
CC=false MPIGRAD_CACHE_DIR="$work/no-compiler" "$work/venv/bin/python" -c "$kernels" \
    | tee "$work/kernels.txt"
grep -q "kernels: numba (no C kernels" "$work/kernels.txt"
CC=false MPIGRAD_CACHE_DIR="$work/no-compiler" "$work/venv/bin/python" -c "$lists" \
    | tee "$work/lists.txt"
grep -q "array lists: none" "$work/lists.txt"
CC=false MPIGRAD_CACHE_DIR="$work/no-compiler" PATH="$work/venv/bin:$PATH" \
    timeout -k 10 300 mpiexec -n 2 python -m mpi4py smoke.py
PATH="$work/venv/bin:$PATH" timeout -k 10 300 mpiexec -n 2 mpigrad-bench --layout small \
    --repeats 2 --warmup 1 --backward-ms 0 --no-peers | tail -1
echo "package: built, checked, installed and run from outside the checkout in $((SECONDS - start)) s"

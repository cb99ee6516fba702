#!/usr/bin/env bash
# The GPU check of issue 30 in one command, for the device machine (bench/gpu/README.md says how to call it):
#
#   bash bench/gpu/check.sh          # OUT=/path (default $OUT, else /tmp/gpu-out); PYTHON=python3; WHEELS=bench/gpu/wheels
#
#   1. installs the carried wheels (MPICH, mpi4py) into a private prefix, offline, and builds + installs hpcpipe
#      from this working tree (falling back to PYTHONPATH=src)
#   2. prints GPU, CUDA, CuPy, NumPy, torch, MPI, MPI.Query_cuda_support(), run.tf32 and bfloat16 findings
#   3. runs `pytest -m gpu tests/gpu` (without a GPU they skip, saying why, and are then rehearsed on NumPy)
#   4. runs the GPU benchmark (bench/gpu/bench_gpu.py; without CuPy: the quick rehearsal sizes on the CPU)
#   5. prints the benchmark's tables last
#
# Everything lands under $OUT (at most 8 files, as the device tool brings back): check.log (all of this output),
# env.json, pytest-gpu.xml (+ pytest-rehearsal.xml), bench.json, bench.log. The whole run keeps to
# CHECK_BUDGET_S seconds (default 400: under the 7 minutes the issue allows); the benchmark's phases that no longer
# fit are skipped and named. Exit status: 0 when the gpu tests passed (or skipped) and every benchmark phase that
# ran worked.
set -u -o pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/gpu-out}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-bench/gpu/wheels}
PREFIX=${HPCPIPE_GPU_PREFIX:-/tmp/hpcpipe-gpu}
BUDGET=${CHECK_BUDGET_S:-400}
TESTS_ON=${CHECK_TESTS:-1}          # 0: skip step 3 (a rerun of the benchmark alone)
PYTEST_SELECT=${CHECK_PYTEST_K:-}   # pytest -k expression (a rerun of some tests)
BENCH_ONLY=${BENCH_ONLY:-}          # comma-separated benchmark phases (default all; "none" skips step 4)
mkdir -p "$OUT"
: > "$OUT/check.log"
exec > >(tee -a "$OUT/check.log") 2>&1
export PYTHONUNBUFFERED=1
START=$SECONDS
left() { echo $(( BUDGET - (SECONDS - START) )); }
step() { echo; echo "=== [$(( SECONDS - START )) s] $*"; }

step "machine"
date -u; uname -srm; echo "python: $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"
command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "nvidia-smi: not found (no NVIDIA driver here)"

step "1. carried wheels -> $PREFIX (offline)"
shopt -s nullglob
carried=("$WHEELS"/*.whl)
PYVER=$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
SITE="$PREFIX/lib/python$PYVER/site-packages"
if (( ${#carried[@]} )); then
    for whl in "${carried[@]}"; do
        if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
                --prefix "$PREFIX" "$whl"; then
            echo "installed $(basename "$whl")"
        else
            echo "NOT installed: $(basename "$whl") (pip's message above; a wheel for another Python is skipped)"
        fi
    done
    export PATH="$PREFIX/bin:$PATH"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    if [ -e "$PREFIX/lib/libmpi.so.12" ]; then export MPI4PY_LIBMPI="$PREFIX/lib/libmpi.so.12"; fi
else
    echo "no wheels in $WHEELS: using the MPI this Python already has (see bench/gpu/README.md to carry them)"
fi
if $PY -m pip wheel -q --no-deps --no-index --no-build-isolation -w /tmp/hpcpipe-wheel . && \
        $PY -m pip install -q --no-index --no-deps --no-compile --ignore-installed --prefix "$PREFIX" \
            /tmp/hpcpipe-wheel/hpcpipe-*.whl; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "hpcpipe built from this tree and installed into $PREFIX"
else
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    echo "hpcpipe could not be built here: using PYTHONPATH=$PWD/src"
fi
# the mpiexec of the MPI mpi4py loads: the carried MPICH's, else the one beside this Python (a venv's mpich
# wheel), else the first on PATH (which may be another MPI's: a site module beside a venv)
if (( ${#carried[@]} )) && [ -x "$PREFIX/bin/mpiexec" ]; then
    MPIEXEC="$PREFIX/bin/mpiexec"
else
    BESIDE="$(dirname "$($PY -c 'import sys; print(sys.executable)')")/mpiexec"
    if [ -x "$BESIDE" ]; then MPIEXEC="$BESIDE"; else MPIEXEC="$(command -v mpiexec || true)"; fi
fi
[ -n "$MPIEXEC" ] && export HPCPIPE_GPU_MPIEXEC="$MPIEXEC"
echo "mpiexec: ${MPIEXEC:-none} (first on PATH: $(command -v mpiexec || echo none))"
$PY -c "import hpcpipe, mpi4py; from mpi4py import MPI; print('hpcpipe', hpcpipe.__file__); \
print('mpi4py', mpi4py.__version__, '|', MPI.Get_library_version().splitlines()[0])" || echo "MPI does not load"

step "2. environment"
$PY bench/gpu/env_report.py --out "$OUT/env.json" || echo "env_report failed (status $?)"

HAVE_GPU=0
$PY -c "import cupy, sys; sys.exit(0 if cupy.cuda.runtime.getDeviceCount() > 0 else 1)" 2>/dev/null && HAVE_GPU=1
TESTS=0
SELECT=()
[ -n "$PYTEST_SELECT" ] && SELECT=(-k "$PYTEST_SELECT")
if [ "$TESTS_ON" = 1 ]; then
    step "3. pytest -m gpu tests/gpu (GPU: $([ $HAVE_GPU = 1 ] && echo yes || echo 'no: they skip'))"
    timeout 240 $PY -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider ${SELECT[@]+"${SELECT[@]}"} \
        --junitxml="$OUT/pytest-gpu.xml"
    TESTS=$?
    if [ $HAVE_GPU = 0 ]; then
        step "3b. no GPU: the gpu tests rehearsed on NumPy (HPCPIPE_GPU_REHEARSE=1; both sides NumPy, every piece runs)"
        HPCPIPE_GPU_REHEARSE=1 timeout 600 $PY -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider ${SELECT[@]+"${SELECT[@]}"} \
            --junitxml="$OUT/pytest-rehearsal.xml"
        TESTS=$?
    fi
fi

BENCH=0
if [ "$BENCH_ONLY" != none ]; then
    BUDGET_LEFT=$(( $(left) - 15 ))
    step "4. benchmark (${BUDGET_LEFT} s of the budget left)"
    REHEARSE=()
    [ $HAVE_GPU = 0 ] && REHEARSE=(--rehearse) && BUDGET_LEFT=$(( BUDGET_LEFT > 240 ? BUDGET_LEFT : 240 ))
    $PY bench/gpu/bench_gpu.py --out "$OUT/bench.json" --log "$OUT/bench.log" --budget-s "$BUDGET_LEFT" \
        --only "$BENCH_ONLY" ${REHEARSE[@]+"${REHEARSE[@]}"}
    BENCH=$?
fi

step "done: tests status $TESTS, benchmark status $BENCH; files in $OUT:"
ls -l "$OUT"
[ $TESTS = 0 ] && [ $BENCH = 0 ]

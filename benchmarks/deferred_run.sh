#!/usr/bin/env bash
# The deferred-fit format on a GPU in one device call (docs/kernels.md, "Deferred fitting"): installs the
# wheels carried under .whl/ (fla-core: the FP32 baseline), writes versions (env.txt), builds the CUDA
# libraries it uses (build_cuda.log), runs the pending-update and tensor-core readout GPU tests
# (gpu_tests.log), the deferred PackedStateCache's GPU test (serving_tests.log) and
# benchmarks/bench_deferred.py (bench.log, bench_deferred.json, bench_deferred.md; NO_BENCH=1 skips it), each
# time-boxed, and the SASS profile of the pending and readout bodies (sass.log); about 3 minutes.
#
#   OUT=/some/dir bash benchmarks/deferred_run.sh      (BENCH_ARGS passes options to bench_deferred.py, e.g.
#   BENCH_ARGS="--source old=.whl/packed_step_old.cu": another version of the kernel timed in the same run)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
source benchmarks/carried_wheels.sh
has_cuda || { echo "no CUDA GPU here (use python benchmarks/bench_deferred.py --dry-run on a CPU)"; exit 2; }
carried_wheels
export TRITON_INTERPRET=0
export STEPQUANT_KERNEL_CACHE="${STEPQUANT_KERNEL_CACHE:-$PWD/.kcache}"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import platform, torch, triton, fla; print('python', platform.python_version(), '| torch', \
torch.__version__, '| triton', triton.__version__, '| fla', fla.__version__)"
    date -u
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout "${BUILD_TIMEOUT:-240}" python3 benchmarks/build_cuda.py --jobs "$(nproc)" --deferred-only \
    > "$OUT/build_cuda.log" 2>&1
echo "build exit $?"; tail -n 1 "$OUT/build_cuda.log"
# registers and instructions of the 6-bit bodies with pending updates, and of the readout without them, its
# sums on tensor cores and on FP32 FMAs (nvcc only; beside the tests)
{
    for part in readout fused writeback; do
        timeout 120 python3 benchmarks/sass_cuda.py --kind 6 --part $part --refits 0 --row-fill --pending | tail -n 1
    done
    for mma in "" --no-mma; do
        timeout 120 python3 benchmarks/sass_cuda.py --kind 6 --part readout --refits 0 --row-fill $mma | tail -n 1
        timeout 120 python3 benchmarks/sass_cuda.py --kind 6 --part readout --refits 0 --row-fill --pending $mma | tail -n 1
    done
} > "$OUT/sass.log" 2>&1 &
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -m gpu tests/test_cuda_kernel.py \
    -k "pending or deferred or fused_fit or tensor_core" -q -rA \
    -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; tail -n 3 "$OUT/gpu_tests.log"
# PackedStateCache(defer=4) with the shipped checkpoints against the deferred codec (serving_tests.log)
STEPQUANT_UNTUNED_TRITON=1 timeout "${SERVING_TEST_TIMEOUT:-240}" python3 -m pytest -m gpu tests/test_gpu_serving.py \
    -k deferred -q -s -rA -p no:cacheprovider > "$OUT/serving_tests.log" 2>&1
echo "serving tests exit $?"; grep -E "deferred|passed|failed" "$OUT/serving_tests.log" | tail -n 8
if [ -n "${NO_BENCH:-}" ]; then wait; cat "$OUT/sass.log"; exit 0; fi
PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_deferred.py --out "$OUT" \
    ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench exit $?"
wait
cat "$OUT/sass.log"
grep -v "^  " "$OUT/bench.log" | tail -n 60

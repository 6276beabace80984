#!/usr/bin/env bash
# The GPU check and decode benchmark in one call (H200, no internet): installs the wheels carried under
# .whl/ (fla-core; transformers), prints versions, builds the CUDA kernel's libraries (build_cuda.log),
# runs the CUDA kernel's GPU tests, the benchmark, the serving GPU tests, ncu on the CUDA kernel and the
# Triton kernel's GPU tests, in that order (each step time-boxed: *_TIMEOUT variables), and leaves logs
# and results in $OUT (default benchmarks/results): env.txt, build_cuda.log, gpu_tests.log, bench.log,
# bench_decode.json, bench_decode.md, ncu_gdn.txt and ncu_kda.txt (benchmarks/ncu_run.sh; NO_NCU=1 skips;
# NO_BENCH=1 stops after the kernel tests; NO_TRITON_TESTS=1 skips the last step). After the benchmark, the
# deferred-fit step (benchmarks/bench_deferred.py: the whole step amortized over R tokens, against fla FP32
# in the same run; deferred.log, bench_deferred.{json,md}; NO_DEFERRED=1 skips it, DEFERRED_ARGS passes
# options). About 10 minutes in all.
# After the serving tests, the whole-model step (issue 13): the calibrate / eval CUDA-vs-CPU test
# (tests/test_gpu_cli.py, gpu_cli_tests.log), the CUDA-graph decode test (tests/test_gpu_generate.py, gpu_generate_tests.log) and
# benchmarks/bench_generate.py (greedy decode of production-shape random-weight models per state format,
# capacity by allocation vs the model): generate.log, bench_generate.{json,md,png}; NO_GENERATE=1 skips it,
# GENERATE_TIME_LIMIT (its --time-limit: 170 s, or with ONLY_GENERATE what is left of CALL_SECONDS, 585 s,
# the device's 10-minute call less a margin) bounds it, GENERATE_ARGS passes options. ONLY_GENERATE=1 runs just
# the install, the CUDA libraries a serving decode uses and that step, the whole sweep B = 512..32 (382 s on
# 2026-12-04: the GPU tests 96 s, the sweep 257 s): issue 13's items 1-4 in one call.
#
#   OUT=/some/dir bash benchmarks/h200_run.sh          (BENCH_ARGS=--quick for a shorter benchmark)
#   ONLY_GENERATE=1 OUT=/some/dir bash benchmarks/h200_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"

source benchmarks/carried_wheels.sh
if ! has_cuda; then
    echo "no CUDA GPU here: this script is for the H200 (use bench_decode.py --dry-run on a CPU)"
    exit 2
fi
carried_wheels  # .whl/ into /tmp/site; PYTHONPATH
export TRITON_INTERPRET=0  # tests/test_kernels.py would otherwise default to the CPU interpreter
export STEPQUANT_KERNEL_CACHE="${STEPQUANT_KERNEL_CACHE:-$PWD/.kcache}"
# autotuned Triton kernels (fla's chunk prefill) run their first configuration: seconds, not minutes, of
# compilation on this bare machine (stepquant.kernels.prefill.untuned_triton_autotune; TUNED_TRITON=1 keeps
# the autotuning)
[ -n "${TUNED_TRITON:-}" ] || export STEPQUANT_UNTUNED_TRITON=1

python3 - > "$OUT/env.txt" 2>&1 <<'EOF'
import platform, torch, triton
print("python", platform.python_version(), "| torch", torch.__version__, "| triton", triton.__version__)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
      "| capability", torch.cuda.get_device_capability() if torch.cuda.is_available() else "-")
for name in ("fla", "transformers"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as err:
        print(name, "unavailable:", repr(err))
EOF
cat "$OUT/env.txt"

generate_step() {  # the whole-model step: calibrate/eval on CUDA vs CPU, then bench_generate.py
    gpu_tests tests/test_gpu_cli.py "${CLI_TEST_TIMEOUT:-120}" gpu_cli_tests.log
    # the CUDA-graph decode bench_generate.py replays: graph steps = eager steps, per family and format
    gpu_tests tests/test_gpu_generate.py "${GENERATE_TEST_TIMEOUT:-180}" gpu_generate_tests.log
    echo "== whole-model decode and capacity (benchmarks/bench_generate.py)"
    # alone (ONLY_GENERATE=1) the step has what is left of the call for the whole sweep B = 512..32 (about
    # 260 s on the H200; 30 s kept for the plot and the exit); after the kernel tests and the benchmark it
    # keeps to 170 s (the decode runs past the limit are skipped and listed)
    local limit=170
    [ -z "${ONLY_GENERATE:-}" ] || limit=$((${CALL_SECONDS:-585} - SECONDS - 30))
    limit=${GENERATE_TIME_LIMIT:-$limit}
    echo "bench_generate.py --time-limit $limit (${SECONDS} s into the call)"
    PYTHONUNBUFFERED=1 timeout -s INT ${GENERATE_TIMEOUT:-$((limit + 25))} python3 benchmarks/bench_generate.py \
        --time-limit "$limit" --out "$OUT" ${GENERATE_ARGS:-} > "$OUT/generate.log" 2>&1
    echo "bench_generate.py exit $? (log: $OUT/generate.log)"
    grep -v "falling back" "$OUT/generate.log" | tail -n 60
}

echo "== CUDA decode kernel: nvcc builds of every configuration the tests and the benchmark use"
timeout ${BUILD_TIMEOUT:-240} python3 benchmarks/build_cuda.py --jobs "$(nproc)" ${ONLY_GENERATE:+--serving-only} \
    > "$OUT/build_cuda.log" 2>&1
echo "build exit $? (log: $OUT/build_cuda.log)"
tail -n 1 "$OUT/build_cuda.log"

# GPU tests, one file at a time, each test time-boxed (pytest-timeout) so a hang names itself
gpu_tests() {  # file, seconds[, log name]
    local log="$OUT/${3:-gpu_tests.log}" start=$SECONDS
    echo "== pytest -m gpu $1" | tee -a "$log"
    timeout -s INT "$2" python3 -m pytest -m gpu "$1" -q -s -p no:cacheprovider -rA --timeout 120 \
        >> "$log" 2>&1
    echo "pytest exit $? ($1, $((SECONDS - start)) s)" | tee -a "$log"
    tail -n 3 "$log"
}
if [ -n "${ONLY_GENERATE:-}" ]; then generate_step; exit 0; fi
gpu_tests tests/test_cuda_kernel.py "${CUDA_TEST_TIMEOUT:-150}"
# STEPQUANT_CUDA_ROWS=8 before this script runs the same tests on the 16-warp build (SQ_ROWS = 8)

if [ -n "${NO_BENCH:-}" ]; then exit 0; fi
echo "== decode benchmark"
timeout ${BENCH_TIMEOUT:-280} python3 benchmarks/bench_decode.py --out "$OUT" ${BENCH_ARGS:-} 2> "$OUT/bench.log" | tee -a "$OUT/bench.log"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
    echo "bench_decode.py exit $status; last log lines:"
    tail -n 25 "$OUT/bench.log"
fi

if [ -z "${NO_DEFERRED:-}" ]; then
    echo "== deferred fitting (benchmarks/bench_deferred.py)"
    PYTHONUNBUFFERED=1 timeout ${DEFERRED_TIMEOUT:-150} python3 benchmarks/bench_deferred.py --out "$OUT" \
        --every 4,8 ${DEFERRED_ARGS:-} > "$OUT/deferred.log" 2>&1
    echo "bench_deferred.py exit $?"
    grep -v "^  " "$OUT/deferred.log" | grep -v "split fit\|torch gates" | tail -n 40
fi

[ -n "${NO_SERVING_TESTS:-}" ] || gpu_tests tests/test_gpu_serving.py "${SERVING_TEST_TIMEOUT:-360}"  # fla autotunes: minutes
[ -n "${NO_GENERATE:-}" ] || generate_step

if command -v ncu > /dev/null && [ -z "${NO_NCU:-}" ]; then
    bash benchmarks/ncu_run.sh  # ncu_gdn.txt, ncu_kda.txt (SASS=1: the source counters too)
fi
[ -n "${NO_TRITON_TESTS:-}" ] || gpu_tests tests/test_kernels.py "${TRITON_TEST_TIMEOUT:-200}"
exit "$status"

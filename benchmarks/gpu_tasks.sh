#!/usr/bin/env bash
# The lm-eval model `stepquant` on the GPU (issue 16): its CUDA path (PackedStateCache for a calibrated plan)
# against the CPU, and the offline task table of docs/tasks.md section 4 with every default method, on one
# H200 with no internet, in about 7 minutes. Needs the wheels carried under .whl/: fla-core and the slim
# transformers as for h200_run.sh, and lm-eval with what it needs (`bash benchmarks/lm_eval_wheels.sh` puts
# them in .whl/lm_eval/). Steps, each time-boxed:
#
#   1. install .whl/*.whl and .whl/lm_eval/*.whl into /tmp/site, unpack .whl/*.tgz there (as h200_run.sh);
#   2. env.txt: versions, whether lm_eval imports, every requirement of lm-eval installed in a satisfying
#      version (benchmarks/lm_eval_deps.py installed), then the nvcc builds of the CUDA decode / pack
#      libraries the shipped plans use (12 configurations since the STEPQuant plans run r0 / r1, 6 before;
#      in parallel: ~40 s for the 6 instead of ~3 min one by one);
#   3. gpu_tasks_tests.log: pytest -m gpu tests/test_gpu_tasks.py (TESTS_TIMEOUT, default 200 s);
#   4. tasks.log and tasks/ (tasks.json, tasks.md, tasks_gdn.png, tasks_kda.png): `stepquant tasks --model
#      gdn,kda --device cuda` with the 18 default methods, TASKS_LIMIT documents per task (default 300: all
#      300 cloze passages and all 60 continuations), batch size TASKS_BATCH (default TASKS_LIMIT: one batch
#      per task, so the time hardly depends on the limit), decode context 32 as in the committed CPU table.
#      The step gets what is left of BUDGET (default 470 s from the start; at least 60 s); tasks.json is
#      rewritten after every method, so a cut run keeps the methods done.
#
# Seven files in $OUT (the device returns at most eight). STEPQUANT_UNTUNED_TRITON=1 (fla's autotuned chunk
# kernels run their first configuration; TUNED_TRITON=1 keeps the autotuning) applies to the tests through
# tests/conftest.py and to step 4 through the same call. DRY_RUN=1 checks the script on a machine without a
# GPU: no install (this machine's packages), no nvcc builds, the tests skip, step 4 runs on the CPU with
# --threads 1 (set TASKS_LIMIT=2 TASKS_METHODS=fp32,int6,stepquant-6 to keep it short).
#
#   OUT=/some/dir bash benchmarks/gpu_tasks.sh
#   DRY_RUN=1 TASKS_LIMIT=2 TASKS_METHODS=fp32,int6,stepquant-6 OUT=/tmp/gt bash benchmarks/gpu_tasks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/tasks_gpu}"
mkdir -p "$OUT"
BUDGET=${BUDGET:-470}
DEVICE=cuda
EXTRA=()
if [ -n "${DRY_RUN:-}" ]; then
    DEVICE=cpu
    EXTRA=(--threads 1)
    echo "DRY_RUN: no install, no nvcc builds, stepquant tasks on the CPU"
elif ! (source benchmarks/carried_wheels.sh && has_cuda); then
    echo "no CUDA GPU here: this script is for the H200 (DRY_RUN=1 checks it on a CPU)"
    exit 2
fi

if [ -z "${DRY_RUN:-}" ]; then
    echo "== install the carried wheels into /tmp/site"
    if compgen -G ".whl/lm_eval/*.whl" > /dev/null; then :; else
        echo "no .whl/lm_eval/*.whl: run bash benchmarks/lm_eval_wheels.sh where pip reaches PyPI (the tests will skip)"
    fi
    source benchmarks/carried_wheels.sh && carried_wheels .whl/lm_eval/*.whl
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export TRITON_INTERPRET=0
export STEPQUANT_KERNEL_CACHE="${STEPQUANT_KERNEL_CACHE:-$PWD/.kcache}"
[ -n "${TUNED_TRITON:-}" ] || export STEPQUANT_UNTUNED_TRITON=1

echo "== versions, lm-eval's requirements, CUDA libraries of the shipped plans (env.txt)"
{
    python3 - <<'EOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__,
      "| gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
for name in ("triton", "fla", "transformers", "lm_eval", "datasets", "evaluate", "pyarrow", "huggingface_hub",
             "fsspec"):
    try:
        module = __import__(name)
        print(f"{name} {getattr(module, '__version__', '?')} ({module.__file__})")
    except Exception as err:
        print(f"{name} unavailable: {err!r}")
try:
    import lm_eval.evaluator  # noqa: F401  what stepquant tasks uses
    print("lm_eval imports: yes")
except Exception as err:
    print(f"lm_eval imports: NO ({err!r})")
EOF
    echo "-- lm-eval's requirements (benchmarks/lm_eval_deps.py installed)"
    python3 benchmarks/lm_eval_deps.py installed
    echo "lm_eval_deps exit $?"
    if [ -z "${DRY_RUN:-}" ]; then
        echo "-- nvcc builds of the CUDA libraries the shipped plans' packed caches launch"
        timeout "${BUILD_TIMEOUT:-120}" python3 - <<'EOF'
import os, time
from concurrent.futures import ThreadPoolExecutor
import torch
from stepquant import assets
from stepquant.calibrate import Plan
from stepquant.families import shape_from_config
from stepquant.integrations.packed_cache import PackedStateCache
from stepquant.kernels.decode import cuda
from stepquant.models import resolve
from transformers import AutoConfig

started, target = time.time(), "%d%d" % torch.cuda.get_device_capability()
defines = {}
for name in ("gdn", "kda"):
    config = AutoConfig.from_pretrained(resolve(name), local_files_only=True)
    kda = shape_from_config(config).family.name == "kda"
    for plan_dir in sorted(p for p in (assets.PLANS / name).iterdir() if p.is_dir()):
        pool = PackedStateCache(config, Plan.load(plan_dir, model_config=config), max_batch=1, device="cuda").pool
        for layer in pool.layers:  # the decode step (fused) and the boundary pack
            defines[cuda.defines_for(layer.tables, "fused", kda)] = None
            defines[cuda.defines_for(layer.tables, "pack", False)] = None
with ThreadPoolExecutor(os.cpu_count()) as workers:
    list(workers.map(lambda d: cuda.build(d, target), defines))
print(f"built {len(defines)} libraries for sm_{target} in {time.time() - started:.1f} s")
EOF
        echo "build exit $?"
    fi
} > "$OUT/env.txt" 2>&1
grep -v "^[a-z0-9-]* .* ok  \[" "$OUT/env.txt"  # the versions, problems and build lines

echo "== pytest -m gpu tests/test_gpu_tasks.py (gpu_tasks_tests.log)"
per_test=()  # pytest-timeout names a hanging test (the H200 image has it)
python3 -c "import pytest_timeout" 2> /dev/null && per_test=(--timeout 200)
timeout -s INT "${TESTS_TIMEOUT:-200}" python3 -m pytest -m gpu tests/test_gpu_tasks.py -q -s -rA \
    -p no:cacheprovider "${per_test[@]}" > "$OUT/gpu_tasks_tests.log" 2>&1
echo "pytest exit $?"
grep -iE "^(gdn|kda)|passed|failed|skipped|error" "$OUT/gpu_tasks_tests.log" | tail -n 40

methods=${TASKS_METHODS:-$(python3 -c "from stepquant.eval.methods import DEFAULT_METHODS; print(','.join(DEFAULT_METHODS))")}
limit=${TASKS_LIMIT:-300}
left=$((BUDGET - SECONDS))
[ "$left" -ge 60 ] || left=60
echo "== stepquant tasks --device $DEVICE, limit $limit, $methods ($left s left; tasks.log, tasks/)"
PYTHONUNBUFFERED=1 timeout -s INT "${TASKS_TIMEOUT:-$left}" python3 - tasks --model gdn,kda --device "$DEVICE" \
    --methods "$methods" --limit "$limit" --batch-size "${TASKS_BATCH:-$limit}" --decode-context 32 \
    "${EXTRA[@]}" --out "$OUT/tasks" > "$OUT/tasks.log" 2>&1 <<'EOF'
import os, sys
if os.environ.get("STEPQUANT_UNTUNED_TRITON") == "1":  # as tests/conftest.py does for the tests
    from stepquant.kernels.prefill import untuned_triton_autotune
    untuned_triton_autotune()
from stepquant.cli import main
sys.argv[0] = "stepquant"  # tasks.json records the command from sys.argv
sys.exit(main(sys.argv[1:]))
EOF
status=$?
echo "stepquant tasks exit $status (after ${SECONDS} s in all)"
grep -v "it/s\]\|s/it\]\|Custom kwargs\|For example --metadata\|falling back" "$OUT/tasks.log" | tail -n 60
exit "$status"

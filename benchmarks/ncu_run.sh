#!/usr/bin/env bash
# Hardware-counter profile of the CUDA decode kernel (ncu on the GPU machine): GDN and KDA at B = 512, 6 bits,
# the launches of benchmarks/ncu_step.py (readout and writeback of the split step and the fused step with one
# refit, then the fused step without a refit; the first round of four is skipped). Per model: ncu_<model>.txt,
# the sections (speed of light, occupancy, launch, warp states, scheduler, pipes, instruction mix, shared
# memory tables); with SASS=1 also ncu_<model>_sass.txt, benchmarks/ncu_sass_summary.py on the per-SASS-
# instruction source counters of the two fused launches (where the warps wait, by opcode and instruction).
# benchmarks/h200_run.sh runs it after the benchmark (NO_NCU=1 skips); alone it needs the environment that
# script sets up (PYTHONPATH with the wheels and the repository, the kernel cache).
#
#   OUT=/some/dir NCU_MODELS="gdn kda" SASS=1 bash benchmarks/ncu_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
command -v ncu > /dev/null || { echo "ncu not found"; exit 2; }
profile() {  # ncu options..., then the launches of benchmarks/ncu_step.py for $model
    timeout ${NCU_TIMEOUT:-150} ncu --clock-control none -k regex:packed_step_kernel "$@" \
        python3 benchmarks/ncu_step.py $([ "$model" = kda ] && echo kda)
}
for model in ${NCU_MODELS:-gdn kda}; do
    echo "== ncu sections, $model: readout, writeback, fused r1, fused r0"
    profile --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats \
        --section MemoryWorkloadAnalysis_Tables --launch-skip 4 --launch-count 4 > "$OUT/ncu_$model.txt" 2>&1
    echo "ncu exit $? ($OUT/ncu_$model.txt)"
    [ -n "${SASS:-}" ] || continue
    echo "== ncu source counters, $model: fused r1, fused r0"
    profile --section SourceCounters --launch-skip 6 --launch-count 2 --page source --print-source sass --csv \
        > "/tmp/ncu_${model}_sass.csv" 2> "$OUT/ncu_${model}_sass.err"
    echo "ncu exit $?"
    python3 benchmarks/ncu_sass_summary.py "/tmp/ncu_${model}_sass.csv" > "$OUT/ncu_${model}_sass.txt" 2>&1
    echo "summary exit $? ($OUT/ncu_${model}_sass.txt)"
done

#!/usr/bin/env bash
# The quantizer ablation of docs/eval.md section 9 (issue 14, item 1) on one GPU: for each <model>-<bits>
# of RUNS (the shipped models at both budgets; ~2 min calibration + ~3 min probe each on the H200),
# `stepquant calibrate --grid midtread` recalibrates the STEPQuant plan (its d_u(b) table measured under
# the mid-tread grid, then bits, w and pivots allocated on it; the shipped plan's division and refits:
# reciprocal, 1 refit at 4 bits, 0 at 6), then
# `python -m studies.attribution --quick --device cuda --recalibrated` probes the shipped plan, its
# single-knob swaps (grid, row statistic, refits 0/1/2, clipping, w) and the recalibrated plan in one
# batched decode loop (--no-per-layer). Needs the wheels of h200_run.sh under .whl/ (fla-core, the slim
# transformers). One 10-minute device call holds two runs; a warm machine reuses the plans in /tmp/ablation.
#
#   OUT=/some/dir bash benchmarks/quantizer_ablation.sh   # $OUT: calibrate_<run>.log and
#                                                         # attribution_<model>_<bits>_swaps.md/json
#   OUT=/some/dir ONLY=stepquant+row-meanabs TAG=rowstat bash benchmarks/quantizer_ablation.sh
#       # no recalibration: only the named swaps of the shipped plans (a cheap probe), files
#       # attribution_<model>_<bits>_swaps_<TAG>.md/json
# The steps (versions, timings, each probe's last line) are printed and kept in /tmp/ablation/steps.txt
# with the probes' full logs and the plans: at most 8 files come back from a device call.
# Without a GPU it runs on the CPU (hours at these settings: the budget stops it; for a syntax check only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/quantizer_ablation}"
WORK=/tmp/ablation  # the recalibrated plans; a later call on a warm machine reuses them
RUNS=${RUNS:-"kda-4 gdn-4 kda-6 gdn-6"}  # <model>-<bits>, in this order until BUDGET runs out
BUDGET=${BUDGET:-560}  # seconds for the whole script; a step starts only with 60 s left
ONLY=${ONLY:-} TAG=${TAG:-only}
mkdir -p "$OUT" "$WORK"
STEPS="$WORK/steps.txt"
source benchmarks/carried_wheels.sh && carried_wheels  # .whl/ into /tmp/site; PYTHONPATH
DEVICE=cuda
has_cuda || DEVICE=cpu
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')" | tee "$STEPS"
left() { echo $((BUDGET - SECONDS)); }
for run in $RUNS; do
    model=${run%-*} bits=${run#*-}
    refits=$([ "$bits" = 4 ] && echo 1 || echo 0)
    plans="$WORK/plans_midtread/$model-$bits"
    if [ -n "$ONLY" ]; then  # the named swaps of the shipped plans only, no recalibration
        probe=(--only "$ONLY" --tag "$TAG") log="$WORK/attribution_${run}_$TAG.log"
    else
        probe=(--recalibrated "$plans") log="$WORK/attribution_$run.log"
    fi
    if [ -z "$ONLY" ] && [ ! -e "$plans/stepquant-$bits/plan.json" ]; then
        [ "$(left)" -gt 60 ] || { echo "out of time before calibrate $run" | tee -a "$STEPS"; break; }
        start=$SECONDS
        timeout "$(left)" python3 -m stepquant.cli calibrate --model "$model" --bits "$bits" \
            --variant stepquant --grid midtread --division reciprocal --refit-iters "$refits" \
            --device "$DEVICE" --replay-device "$DEVICE" --no-progress --out "$plans" \
            > "$OUT/calibrate_$run.log" 2>&1
        echo "calibrate $run: rc $? in $((SECONDS - start)) s" | tee -a "$STEPS"
    fi
    [ "$(left)" -gt 60 ] || { echo "out of time before attribution $run" | tee -a "$STEPS"; break; }
    start=$SECONDS
    timeout "$(left)" python3 -m studies.attribution --model "$model" --bits "$bits" --quick \
        --device "$DEVICE" "${probe[@]}" --no-per-layer --out "$OUT" > "$log" 2>&1
    echo "attribution $run ${probe[*]}: rc $? in $((SECONDS - start)) s" | tee -a "$STEPS"
    tail -n 3 "$log" | tee -a "$STEPS"
done

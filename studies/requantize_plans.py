"""Give calibrated plans another quantizer version: the same bits and w, only the quantizer block changed.

The CUDA decode kernel is fastest with the reciprocal quantizer and one refit or none (docs/kernels.md),
and on the shipped STEPQuant plans that quantizer is no worse in excess NLL with the bits and w they have
(docs/results/quantizer_check.md, quantizer_check_r0.md). Recalibrating with ``stepquant calibrate
--division reciprocal --refit-iters N`` does not give those plans: it measures the distortion table d_u(b)
with the new quantizer, and the allocation then moves a few units by a bit (docs/calibration.md section 6).
So this rewrites plan.json with the current writer (``Plan.write_json``: quantizer block replaced,
integrity recomputed) and leaves plan.safetensors untouched; its distortion array stays the table the bits
were allocated from. The calibration block keeps the command that made the bits and records the change:

    "requantized": {"from": <the quantizer the plan was calibrated with>, "command": <the command below>}

so the plan is reproduced by its calibration "command" followed by its "requantized" command (the plan's
recalibrate hint names both). It checks that the new plan.json differs from the old only in the quantizer,
calibration and integrity blocks, and loads to a plan with the same bits, w and bytes.

    python -m studies.requantize_plans --division reciprocal --refit-iters 0 PLANS/{gdn,kda}/stepquant-6
    python -m studies.requantize_plans --division reciprocal --refit-iters 1 PLANS/{gdn,kda}/stepquant-4

(PLANS = stepquant/assets/plans: the commands that made the shipped STEPQuant plans, issue 12.) Prints one
line per plan and a JSON summary last; a plan that would change otherwise is left as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

from stepquant.calibrate.plan import PLAN_ARRAYS, PLAN_JSON, Plan
from stepquant.calibrate.quantizer import quantizer_to_json
from stepquant.codecs.dual_axis import DIVISIONS
from studies.migrate_plans import rewrite_checked

_CHANGED = {"quantizer", "calibration", "integrity"}


def requantize_command(directory: Path, division: str, refit_iters: int) -> str:
    return (f"python -m studies.requantize_plans --division {division} --refit-iters {refit_iters} "
            f"{shlex.quote(str(directory))}")


def requantize(directory: Path, division: str, refit_iters: int) -> str:
    """Rewrite one plan directory's quantizer; returns "requantized" or "already <division>/<refits>"."""
    json_path, arrays_path = directory / PLAN_JSON, directory / PLAN_ARRAYS
    before_json, arrays = json_path.read_text(), arrays_path.read_bytes()
    plan = Plan.load(directory)
    if plan.spatial != "dual_axis":
        raise ValueError(f"{directory}: a {plan.variant} plan (rowwise absmax) runs no dual-axis quantizer")
    quantizer = dataclasses.replace(plan.quantizer, division=division, refit_iters=refit_iters)
    if quantizer == plan.quantizer:
        return f"already {division}/{refit_iters}"
    calibration = dict(plan.calibration)
    original = calibration.get("requantized", {}).get("from", quantizer_to_json(plan.quantizer))
    calibration["requantized"] = {"from": original,
                                  "command": requantize_command(directory, division, refit_iters)}
    new_plan = dataclasses.replace(plan, quantizer=quantizer, calibration=calibration)
    rewrite_checked(directory, plan, new_plan, before_json, arrays, _CHANGED)
    return "requantized"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.requantize_plans",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("plans", nargs="+", type=Path, help="plan directories")
    parser.add_argument("--division", choices=list(DIVISIONS), required=True)
    parser.add_argument("--refit-iters", type=int, required=True, help="column refits, >= 0")
    args = parser.parse_args(argv)
    results = {}
    for directory in args.plans:
        results[str(directory)] = requantize(directory, args.division, args.refit_iters)
        print(f"{directory}: {results[str(directory)]}")
    requantized = sum(r == "requantized" for r in results.values())
    print(json.dumps({"plans": len(results), "requantized": requantized}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

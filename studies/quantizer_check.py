"""Does the CUDA kernel's quantizer cost quality? Paired excess NLL of shipped plans per quantizer version.

The CUDA decode kernel is fastest with ``division="reciprocal"`` and one refit or none (docs/kernels.md);
the shipped plans were calibrated with the first quantizer (exact division, two refits). This study takes
each shipped STEPQuant and spatial-only plan under the quantizer it was calibrated with (the original: its
quantizer block, or for the STEPQuant plans, which run r0 / r1 since issue 12, the calibration block's
"requantized" "from", studies/requantize_plans.py), writes it again with only its quantizer changed (same
bits, same w): "-r1" reciprocal with one refit, "-r2" reciprocal with two refits, "-r0" reciprocal without
a refit (the column scales stay the clamped column maxima: 22% fewer kernel instructions per value than
r1), and evaluates the original and the versions in one ``stepquant eval --quick`` run per model (same
streams, same batch), then reports each version's excess NLL and its paired difference to the original
over the eval's blocks (mean and standard error of the per-block differences).

    python -m studies.quantizer_check --model gdn --out runs/quantizer_check      # ~40 min on 2 cores
    python -m studies.quantizer_check --model kda --plans stepquant-6,stepquant-4 --versions r0 --out DIR
    python -m studies.quantizer_check --table runs/quantizer_check                # the table only

Writes <out>/<model>/ (the plans and the eval) and, with --table, quantizer_check.md and .json beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from stepquant import assets
from stepquant.calibrate.plan import Plan
from stepquant.calibrate.quantizer import quantizer_from_json
from stepquant.eval.report import paired_difference

BASE_PLANS = ("stepquant-6", "stepquant-4", "spatial-6", "spatial-4")
VERSIONS = {"r0": dict(division="reciprocal", refit_iters=0),
            "r1": dict(division="reciprocal", refit_iters=1),
            "r2": dict(division="reciprocal", refit_iters=2)}


def calibrated(plan: Plan) -> Plan:
    """The plan under the quantizer it was calibrated with (before a studies/requantize_plans.py rewrite)."""
    original = plan.calibration.get("requantized", {}).get("from")
    if original is None:
        return plan
    calibration = {k: v for k, v in plan.calibration.items() if k != "requantized"}
    return dataclasses.replace(plan, quantizer=quantizer_from_json(original), calibration=calibration)


def write_versions(model: str, out: Path, plans=BASE_PLANS, versions=("r1", "r2")) -> list[Path]:
    """The originals, then the quantizer versions, of the named shipped plans of ``model`` under
    out/model/plans, in eval order."""
    originals = [calibrated(Plan.load(assets.PLANS / model / name)) for name in plans]
    paths = [plan.save(out / model / "plans" / name) for name, plan in zip(plans, originals, strict=True)]
    for name, plan in zip(plans, originals, strict=True):
        for tag in versions:
            fields = VERSIONS[tag]
            path = out / model / "plans" / f"{name}-{tag}"
            dataclasses.replace(plan, quantizer=dataclasses.replace(plan.quantizer, **fields)).save(path)
            paths.append(path)
    return paths


def run_eval(model: str, out: Path, plans=BASE_PLANS, versions=("r1", "r2")) -> None:
    paths = write_versions(model, out, plans, versions)
    command = [sys.executable, "-m", "stepquant.cli", "eval", "--models", model, "--methods", "fp32",
               *[a for p in paths for a in ("--plan", str(p))], "--quick",
               "--out", str(out / model / "eval"), "--no-plots"]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)


def table(out: Path) -> dict:
    """Paired differences of every version to its original plan, for each model evaluated under out/."""
    result = {}
    for model_dir in sorted(p for p in out.iterdir() if (p / "eval" / "eval.json").exists()):
        model = model_dir.name
        methods = json.loads((model_dir / "eval" / "eval.json").read_text())["models"][model]["methods"]
        rows = []
        for name in BASE_PLANS:
            if name not in methods:
                continue
            for version in ("", *VERSIONS):
                key = f"{name}-{version}" if version else name
                if key not in methods:
                    continue
                record = methods[key]
                paired = paired_difference(record, methods[name])
                rows.append(dict(plan=name, version=version or "exact/2 (as calibrated)",
                                 excess_nll=record["excess_nll"]["all"]["mean"],
                                 stderr=record["excess_nll"]["stderr"],
                                 paired_diff=paired["diff"], paired_se=paired["se"], blocks=paired["blocks"]))
        result[model] = rows
    return result


def markdown(result: dict) -> str:
    lines = ["# Quantizer versions of the shipped plans: paired excess NLL", "",
             "`python -m studies.quantizer_check --model M --out DIR` (stepquant eval --quick: P = 512, "
             "D = 1024, 3 streams; the same bits and w, only the quantizer changed). r0: reciprocal "
             "division, no refit; r1: reciprocal, one refit (the CUDA kernel's fast path); r2: reciprocal, "
             "two refits. Differences to the plan as calibrated (exact/2) are paired over the eval's blocks "
             "(nats/token, mean +- standard error).", ""]
    for model, rows in result.items():
        lines += [f"## {model}", "", "| plan | quantizer | excess NLL | difference to exact/2 | in SE |",
                  "|---|---|---|---|---|"]
        for r in rows:
            shipped = r["version"].startswith("exact")
            diff = "-" if shipped else f"{r['paired_diff']:+.5f} +- {r['paired_se']:.5f}"
            sigmas = "-" if shipped else f"{r['paired_diff'] / r['paired_se']:+.1f}"
            lines.append(f"| {r['plan']} | {r['version']} | {r['excess_nll']:+.5f} +- {r['stderr']:.5f} | "
                         f"{diff} | {sigmas} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["gdn", "kda"], help="evaluate this shipped model's versions")
    parser.add_argument("--out", type=Path, default=Path("runs/quantizer_check"))
    parser.add_argument("--plans", default=",".join(BASE_PLANS), help="shipped plans to vary (comma list)")
    parser.add_argument("--versions", default="r1,r2", help=f"quantizer versions, of {list(VERSIONS)}")
    parser.add_argument("--table", type=Path, default=None, help="only write the table of an earlier --out")
    args = parser.parse_args(argv)
    if args.table is None:
        if args.model is None:
            parser.error("give --model, or --table DIR")
        plans, versions = args.plans.split(","), args.versions.split(",")
        unknown = [p for p in plans if p not in BASE_PLANS] + [v for v in versions if v not in VERSIONS]
        if unknown:
            parser.error(f"unknown plan or version {unknown}: plans of {list(BASE_PLANS)}, versions of "
                         f"{list(VERSIONS)}")
        run_eval(args.model, args.out, tuple(plans), tuple(versions))
        out = args.out
    else:
        out = args.table
    result = table(out)
    (out / "quantizer_check.json").write_text(json.dumps(result, indent=1))
    (out / "quantizer_check.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Rewrite version-1 plans as plan format version 2: the same plan, with its quantizer block written out.

A version-1 plan.json may lack the "quantizer" block; it then runs V1_QUANTIZER (stepquant.calibrate
.quantizer). Migrating loads each plan (verifying its integrity) and rewrites its plan.json with the current
writer (``Plan.write_json``: format_version 2, the quantizer block explicit, the integrity block
recomputed); plan.safetensors is not touched. It checks that the new plan.json differs from the old only
in format_version, the quantizer block and the integrity block, and loads to a plan with the same
quantizer, bits and row-impact factors.

    python -m studies.migrate_plans stepquant/assets/plans          # every plan below the folder

Prints one line per plan and a JSON summary last; a plan that would change otherwise is left as it was.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from stepquant.calibrate.plan import PLAN_ARRAYS, PLAN_FORMAT_VERSION, PLAN_JSON, Plan

_CHANGED_BY_MIGRATION = {"format_version", "quantizer", "integrity"}


def rewrite_checked(directory: Path, plan: Plan, new_plan: Plan, before_json: str, arrays: bytes,
                    allowed: set[str]) -> None:
    """Write ``new_plan``'s plan.json over ``plan``'s; restore ``before_json`` and raise RuntimeError unless
    only the ``allowed`` top-level fields changed, plan.safetensors is untouched, and the result loads with
    ``new_plan``'s quantizer and ``plan``'s bits, w and bytes (also studies/requantize_plans.py)."""
    json_path = directory / PLAN_JSON
    new_plan.write_json(directory, arrays)
    old, new = json.loads(before_json), json.loads(json_path.read_text())
    changed = {key for key in old.keys() | new.keys() if old.get(key) != new.get(key)}
    problems = []
    if not changed <= allowed:
        problems.append(f"plan.json fields {sorted(changed - allowed)} would change")
    again = Plan.load(directory)
    tables = zip(again.bits + again.w, plan.bits + plan.w, strict=True)
    if not (again.quantizer == new_plan.quantizer and all(torch.equal(a, b) for a, b in tables)
            and again.accounting() == plan.accounting()):
        problems.append("the rewritten plan loads with another quantizer, bits, w or bytes")
    if (directory / PLAN_ARRAYS).read_bytes() != arrays:
        problems.append(f"{PLAN_ARRAYS} changed")
    if problems:
        json_path.write_text(before_json)
        raise RuntimeError(f"{directory}: {'; '.join(problems)}; left unchanged")


def migrate(directory: Path) -> str:
    """Migrate one plan directory; returns "migrated" or "already version N"."""
    json_path, arrays_path = directory / PLAN_JSON, directory / PLAN_ARRAYS
    before_json, before_arrays = json_path.read_text(), arrays_path.read_bytes()
    old = json.loads(before_json)
    if old["format_version"] == PLAN_FORMAT_VERSION:
        return f"already version {PLAN_FORMAT_VERSION}"
    plan = Plan.load(directory)
    rewrite_checked(directory, plan, plan, before_json, before_arrays, _CHANGED_BY_MIGRATION)
    return "migrated"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.migrate_plans",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="plan directories or folders holding them")
    args = parser.parse_args(argv)
    plans = sorted({p.parent for folder in args.folders for p in folder.rglob(PLAN_JSON)})
    if not plans:
        raise SystemExit(f"no {PLAN_JSON} below {', '.join(map(str, args.folders))}")
    results = {}
    for directory in plans:
        results[str(directory)] = migrate(directory)
        print(f"{directory}: {results[str(directory)]}")
    print(json.dumps({"plans": len(results), "migrated": sum(r == "migrated" for r in results.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

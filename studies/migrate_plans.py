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


def migrate(directory: Path) -> str:
    """Migrate one plan directory; returns "migrated" or "already version N"."""
    json_path, arrays_path = directory / PLAN_JSON, directory / PLAN_ARRAYS
    before_json, before_arrays = json_path.read_text(), arrays_path.read_bytes()
    old = json.loads(before_json)
    if old["format_version"] == PLAN_FORMAT_VERSION:
        return f"already version {PLAN_FORMAT_VERSION}"
    plan = Plan.load(directory)
    plan.write_json(directory, before_arrays)
    new = json.loads(json_path.read_text())
    changed = {key for key in old.keys() | new.keys() if old.get(key) != new.get(key)}
    problems = []
    if not changed <= _CHANGED_BY_MIGRATION:
        problems.append(f"plan.json fields {sorted(changed - _CHANGED_BY_MIGRATION)} would change")
    again = Plan.load(directory)
    tables = zip(again.bits + again.w, plan.bits + plan.w, strict=True)
    same = again.quantizer == plan.quantizer and all(torch.equal(a, b) for a, b in tables)
    if not same:
        problems.append("the rewritten plan loads differently")
    if problems:
        json_path.write_text(before_json)
        raise RuntimeError(f"{directory}: {'; '.join(problems)}; left unchanged")
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

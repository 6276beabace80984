"""The quality targets' verdicts (docs/eval.md section 4) from the committed eval: each target as a paired
difference with its standard error, and whether it is met, missed or not resolvable.

A target is a difference d between two rows of one eval run (T1, T8: the row itself against a band). Both
rows come from the same forward passes, so d and its standard error come from the per-block differences
(eval.json ``block_means``: 3 streams x 16 blocks of 64 predictions on the quick protocol). **met** /
**missed**: d is on the target's / the wrong side by more than one standard error; **not resolvable**:
within one (the nominal side in brackets); "weak" marks a margin under two standard errors.

    python -m studies.verdicts docs/results/eval.json.gz       # the markdown table of docs/eval.md section 4
    python -m studies.verdicts docs/results/full_eval_{gdn,kda}.json.gz   # the full protocol's (section 8)

Prints the table, then one JSON line with every d, se and verdict.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stepquant.eval.report import block_means, mean_and_stderr, read_records

# (label, method, reference method or None, reference scale, kind, threshold): d = method - scale x reference;
# kind "below": target d < threshold; "band": target |d| <= threshold
TARGETS = (
    ("T1 STEPQuant@6 within ±0.005 of FP32", "stepquant-6", None, 1.0, "band", 0.005),
    ("T2 STEPQuant@6 − BF16 ≤ 0", "stepquant-6", "bf16", 1.0, "below", 0.0),
    ("T3 STEPQuant@4 − INT6 < 0", "stepquant-4", "int6", 1.0, "below", 0.0),
    ("T4 STEPQuant@4 − INT4/5 ≤ 0", "stepquant-4", "int4", 0.2, "below", 0.0),
    ("T5 STEPQuant − spatial only, @6", "stepquant-6", "spatial-6", 1.0, "below", 0.0),
    ("T5 @4", "stepquant-4", "spatial-4", 1.0, "below", 0.0),
    ("T6 STEPQuant − temporal only, @6", "stepquant-6", "temporal-6", 1.0, "below", 0.0),
    ("T6 @4", "stepquant-4", "temporal-4", 1.0, "below", 0.0),
    ("T7 temporal − temporal w/o pivots, @6", "temporal-6", "temporal-nopivot-6", 1.0, "below", 0.0),
    ("T7 @4", "temporal-4", "temporal-nopivot-4", 1.0, "below", 0.0),
    ("T8 (moonshot) STEPQuant@4 within ±0.01 of FP32", "stepquant-4", None, 1.0, "band", 0.01),
)


def verdict(methods: dict, method: str, reference: str | None, scale: float, kind: str,
            threshold: float) -> dict:
    """d, its paired standard error and the verdict of one target on one model's eval methods."""
    missing = [m for m in (method, reference) if m is not None and m not in methods]
    if missing:
        raise ValueError(f"the eval has no method {missing}: rerun `stepquant eval` with the default "
                         "method list")
    a = block_means(methods[method])
    b = [0.0] * len(a) if reference is None else block_means(methods[reference])
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"{method} and {reference}: paired differences need the same number (>= 2) of "
                         "blocks")
    d, se = mean_and_stderr([x - scale * y for x, y in zip(a, b, strict=True)])
    margin = threshold - (abs(d) if kind == "band" else d)  # > 0: on the target's side
    if abs(margin) <= se:
        text = f"not resolvable (nominally {'met' if margin > 0 else 'missed'})"
        status = "not resolvable"
    else:
        status = "met" if margin > 0 else "missed"
        weak = abs(margin) < 2 * se
        text = f"**{status}**" + (f" (weak, {abs(margin) / se:.1f} se)" if weak else "")
    return {"d": d, "se": se, "verdict": status, "text": text}


def table(record: dict) -> tuple[str, dict]:
    """The markdown verdict table (one column pair per model) and the per-model results.

    A target whose methods an eval did not run (e.g. the full protocol's shorter method list) reads "not
    run" for that model, and a target no model ran is left out and named below the table; an eval with no
    target at all is an error."""
    models = list(record["models"])
    results = {name: {} for name in models}
    header = "| target | " + " | ".join(f"{m}: d ± se | verdict" for m in models) + " |"
    lines, left_out = [header, "|---|" + "---|---|" * len(models)], []
    for label, method, reference, scale, kind, threshold in TARGETS:
        needed = [m for m in (method, reference) if m is not None]
        ran = {name: all(m in record["models"][name]["methods"] for m in needed) for name in models}
        if not any(ran.values()):
            left_out.append(label)
            continue
        cells = []
        for name in models:
            if not ran[name]:
                cells.append("not run | -")
                continue
            methods = record["models"][name]["methods"]
            r = verdict(methods, method, reference, scale, kind, threshold)
            results[name][label] = {k: r[k] for k in ("d", "se", "verdict")}
            detail = ""
            if reference is not None and kind == "below":
                a, b = (methods[m]["excess_nll"]["all"]["mean"] for m in (method, reference))
                detail = f" ({a:.4f} vs {scale * b:.4f})"
            cells.append(f"{r['d']:+.4f} ± {r['se']:.4f}{detail} | {r['text']}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if len(left_out) == len(TARGETS):
        raise ValueError("the eval has none of the targets' methods: rerun `stepquant eval` with the default "
                         "method list")
    text = "\n".join(lines) + "\n"
    if left_out:
        text += "\nNot run in this eval (its method list lacks them): " + "; ".join(left_out) + ".\n"
    return text, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.verdicts", description=__doc__.split("\n")[0])
    parser.add_argument("eval_json", nargs="*", type=Path, default=[Path("docs/results/eval.json.gz")],
                        help="eval.json (or .json.gz) files written by `stepquant eval`, their models "
                             "side by side (default docs/results/eval.json.gz)")
    args = parser.parse_args(argv)
    path = ", ".join(map(str, args.eval_json))
    try:
        record = read_records(args.eval_json)
        text, results = table(record)
    except (OSError, EOFError, json.JSONDecodeError, KeyError) as err:  # EOFError: a truncated .gz
        parser.error(f"{path}: not a readable eval.json ({err!r}); write one with `stepquant eval --out DIR`")
    except ValueError as err:
        parser.error(f"{path}: {err}")
    print(f"Verdicts of {path} ({record.get('date')}, {record.get('settings', {}).get('prefill')} + "
          f"{record.get('settings', {}).get('decode')} tokens):\n")
    print(text)
    print(json.dumps(results, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

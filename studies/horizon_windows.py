"""Excess NLL in windows of decode steps, from an eval.json (docs/eval.md section 8, the longer horizon).

`stepquant eval` keeps each method's per-step excess-NLL curve (mean over streams) in its JSON; a long
horizon's drift is read in windows of it: the mean over steps [a, b) of each window, the all-D mean with its
standard error, and the paired difference to a base method (eval.json ``block_means``).

    python -m studies.horizon_windows /tmp/hz/eval.json --base int6     # the markdown rows of section 8

Windows default to the first 256 steps and the 256 ending at each third of D (D = 3,072: steps 0-255,
768-1,023, 1,792-2,047 and 2,816-3,071).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stepquant.eval.report import paired_difference, read_records


def default_windows(steps: int, width: int = 256) -> list[tuple[int, int]]:
    """The first ``width`` steps and the ``width`` ending at each third of ``steps`` (fewer when short)."""
    if steps < width:
        return [(0, steps)]
    ends = sorted({width} | {max(width, k * steps // 3) for k in (1, 2, 3)})
    return [(end - width, end) for end in ends]


def window_means(curve: list[float], windows: list[tuple[int, int]]) -> list[float]:
    if not windows or any(not 0 <= a < b <= len(curve) for a, b in windows):
        raise ValueError(f"windows {windows} must lie inside the curve's {len(curve)} steps")
    return [sum(curve[a:b]) / (b - a) for a, b in windows]


def rows(record: dict, base: str | None, windows: list[tuple[int, int]] | None = None) -> list[str]:
    """One markdown row per model and method: window means, the all-D mean ± se, and (with ``base``) the
    paired difference to the base method of the same model."""
    out = []
    for name, model in record["models"].items():
        methods = model["methods"]
        if base is not None and base not in methods:
            raise ValueError(f"{name}: no method {base!r} to pair against; the methods are {sorted(methods)}")
        for method, result in methods.items():
            curve = result["curve"]
            means = window_means(curve, windows or default_windows(len(curve)))
            excess = result["excess_nll"]
            cells = [f"{m:+.4f}" for m in means] + [f"{excess['all']['mean']:+.4f} ± {excess['stderr']:.4f}"]
            if base is not None:
                if method == base:
                    cells.append("-")
                else:
                    pair = paired_difference(result, methods[base])
                    cells.append(f"{pair['diff']:+.4f} ± {pair['se']:.4f}")
            out.append(f"| {name} {method} | " + " | ".join(cells) + " |")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("eval_json", type=Path, nargs="+",
                        help="eval.json (or .json.gz) files written by `stepquant eval`, their models merged")
    parser.add_argument("--base", default=None, help="pair every method against this one (e.g. int6)")
    args = parser.parse_args(argv)
    record = read_records(args.eval_json)
    print("\n".join(rows(record, args.base)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

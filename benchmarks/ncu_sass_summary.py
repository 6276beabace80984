"""Where a kernel's warps wait, from ncu's per-SASS-instruction source counters (CSV of the source page).

The CSV holds, per SASS instruction, how often it executed and the warp-state samples taken on it (stall
reasons). This prints per kernel launch: the stall reasons over all samples, the executed instructions by
opcode, the samples by opcode, and the instructions with the most samples and their main reason: what
to attack next in packed_step.cu (docs/kernels.md, "Roofline").

    ncu --section SourceCounters -k regex:packed_step_kernel --launch-skip 4 --launch-count 2 \\
        --page source --print-source sass --csv python3 benchmarks/ncu_step.py kda > ncu_kda_sass.csv
    python benchmarks/ncu_sass_summary.py ncu_kda_sass.csv
"""

from __future__ import annotations

import collections
import csv
import sys


def opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):  # a predicate guard
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def summarize(rows: list[list[str]], header: list[str], top: int = 12) -> list[str]:
    col = {h: i for i, h in enumerate(header)}

    def num(row, name):
        return float(row[col[name]].replace(",", "") or 0)

    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    reasons = collections.Counter()
    executed, sampled = collections.Counter(), collections.Counter()
    for row in rows:
        for h in stalls:
            reasons[h[len("stall_"):]] += num(row, h)
        op = opcode(row[col["Source"]])
        executed[op] += num(row, "Instructions Executed")
        sampled[op] += num(row, "Warp Stall Sampling (All Samples)")
    samples, total = sum(reasons.values()), sum(executed.values())

    def share(counter, whole, n):
        return ", ".join(f"{k} {100 * v / whole:.1f}%" for k, v in counter.most_common(n))

    lines = [f"{len(rows)} SASS instructions, {total:.4g} warp instructions executed, {samples:.0f} samples",
             f"  warp states: {share(reasons, samples, 12)}",
             f"  executed by opcode: {share(executed, total, 18)}",
             f"  samples by opcode: {share(sampled, samples, 12)}",
             "  most sampled instructions (samples, executions, main state):"]
    for row in sorted(rows, key=lambda r: -num(r, "Warp Stall Sampling (All Samples)"))[:top]:
        main = max(stalls, key=lambda h: num(row, h))[len("stall_"):]
        lines.append(f"    {row[col['Source']][:64]:64} {num(row, 'Warp Stall Sampling (All Samples)'):7.0f} "
                     f"{num(row, 'Instructions Executed'):10.3g}  {main}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    lines = open(argv[0]).read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')]
    if not starts:
        raise SystemExit(f"{argv[0]}: no kernel in this CSV (ncu --page source --csv output expected)")
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        table = list(csv.reader(lines[start + 1:end]))
        header, rows = table[0], [r for r in table[1:] if len(r) == len(table[0])]
        print(f"== launch {n + 1}: " + "\n".join(summarize(rows, header)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

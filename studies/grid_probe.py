"""Mid-rise (the codec default) vs mid-tread grid under the shipped calibrated plans, on the drift probe.

The KDA error attribution at 4 bits (docs/results/attribution_kda_4.md) showed STEPQuant's plan doing
twice as well on the mid-tread grid. This script asks whether that holds across models, budgets and
variants: for each shipped model it runs the drift probe (--quick lengths: P = 512, D = 1024, one
segment of wiki, sotu and brown) on FP32, uniform INT4/INT6, and the stepquant / spatial plans at 4 and
6 bits on both grids (temporal plans use rowwise absmax, which is mid-tread already).

    python -m studies.grid_probe --model gdn --out docs/results     # ~9 min on one CPU core
    python -m studies.grid_probe --model kda --out docs/results     # ~7 min

Writes grid_probe_<model>.json and .md (excess NLL in nats per predicted token vs the FP32 state).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from stepquant.codecs import Grid, MixedCodec, make_codec
from stepquant.data import segments as cut_segments
from stepquant.eval.methods import DEFAULT_PLANS_DIR, load_plan, plan_path
from stepquant.eval.probe import drift_probe
from stepquant.eval.settings import SHIPPED_STREAMS
from stepquant.families import linear_layers
from stepquant.models import load


def variants(model, name: str) -> list[tuple[str, dict]]:
    layers = list(linear_layers(model.config))
    out = [("fp32", dict.fromkeys(layers, make_codec("fp32")))]
    for bits in (4, 6):
        out.append((f"int{bits}", dict.fromkeys(layers, make_codec(f"int{bits}"))))
        for variant in ("stepquant", "spatial", "temporal"):
            plan = load_plan(plan_path(f"{variant}-{bits}", name, DEFAULT_PLANS_DIR), model.config)
            codecs = [plan.codec(i) for i in range(len(layers))]
            out.append((f"{variant}-{bits}", dict(zip(layers, codecs, strict=True))))
            if variant != "temporal":
                midtread = dataclasses.replace(codecs[0].config, grid=Grid.MIDTREAD)
                out.append((f"{variant}-{bits}+midtread", {
                    layer: MixedCodec(bits=plan.bits[i], w=plan.w[i], spatial="dual_axis", config=midtread)
                    for i, layer in enumerate(layers)}))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, choices=["gdn", "kda"])
    parser.add_argument("--out", type=Path, default=Path("eval_results"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    todo = variants(model, args.model)
    tokens = torch.cat([cut_segments(d, tokenizer, 1, 512 + 1024 + 1) for d in SHIPPED_STREAMS])
    started = time.time()
    probe = drift_probe(model, tokens, [codecs for _, codecs in todo], prefill_len=512, window=256,
                        desc=f"{args.model} grid probe")
    rows = {}
    lines = [f"# Mid-rise vs mid-tread grid: {args.model}", "",
             f"`python -m studies.grid_probe --model {args.model} --out {args.out}`; "
             f"{time.strftime('%Y-%m-%d')}, {torch.get_num_threads()} torch thread(s), "
             f"{time.time() - started:.0f} s. Drift probe P = 512, D = 1024, streams "
             f"{', '.join(SHIPPED_STREAMS)}; excess NLL (nats per predicted token) vs the FP32 state.", "",
             "| method | first 256 | last 256 | all 1024 |", "|---|---|---|---|"]
    for m, (name, _) in enumerate(todo):
        row = dict(first=float(probe.excess.first[m].mean()), last=float(probe.excess.last[m].mean()),
                   all=float(probe.excess.all[m].mean()), stderr=float(probe.excess.stderr[m]))
        rows[name] = row
        lines.append(f"| {name} | {row['first']:+.4f} | {row['last']:+.4f} | "
                     f"{row['all']:+.4f} ± {row['stderr']:.4f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"grid_probe_{args.model}.json").write_text(json.dumps(rows, indent=1))
    (args.out / f"grid_probe_{args.model}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

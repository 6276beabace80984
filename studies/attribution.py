"""Error attribution: where a STEPQuant variant's excess NLL comes from (docs/eval.md section 4).

Runs the drift probe of `stepquant eval` (one FP32 prefill per stream, every variant in one batched decode
loop) on diagnostic variants built from a model's calibrated plans at one budget b:

- per layer: STEPQuant@b and temporal only@b on one linear-attention layer, FP32 elsewhere;
- quantizer swaps with the bits held fixed: STEPQuant's bit plan under the absmax quantizer (temporal-only
  quantizer), temporal's bit plan under the dual-axis quantizer, and STEPQuant's dual-axis quantizer with
  one knob changed at a time (midtread grid, w = 1, the plain w^2 refit, no refit, no clipping, absmax row
  statistic);
- with ``--heads-of-layer L``: STEPQuant@b and temporal only@b on each head of layer L on its own.

    python -m studies.attribution --model kda --bits 4 --quick --out docs/results

Writes attribution_<model>_<bits>.json and .md into --out, prints the table and one JSON line last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from stepquant.codecs import Grid, MixedCodec, make_codec
from stepquant.data import segments as cut_segments
from stepquant.eval.methods import DEFAULT_PLANS_DIR, load_plan, plan_path
from stepquant.eval.probe import drift_probe
from stepquant.eval.run import machine
from stepquant.eval.settings import DEFAULT_WINDOW, FULL, QUICK, SHIPPED_STREAMS
from stepquant.families import linear_layers as linear_layers_of
from stepquant.models import load


def diagnostic_variants(plans: dict, linear_layers: list[int], bits: int) -> list[tuple[str, str, dict]]:
    """(name, description, {model layer: codec}) of every diagnostic variant; plans = {variant: Plan}."""
    step, temporal = plans["stepquant"], plans["temporal"]
    fp32 = make_codec("fp32")
    uniform = make_codec(f"int{bits}")
    step_codecs = [step.codec(i) for i in range(len(linear_layers))]
    config = step_codecs[0].config

    def mixed(plan, spatial="dual_axis", w_plan=None, **changes):
        w_plan = plan if w_plan is None else w_plan
        cfg = dataclasses.replace(config, **changes)
        return {layer: MixedCodec(bits=plan.bits[i], w=w_plan.w[i], spatial=spatial, config=cfg)
                for i, layer in enumerate(linear_layers)}

    variants = [
        (f"int{bits}", f"INT{bits} rowwise absmax, every layer", dict.fromkeys(linear_layers, uniform)),
        (f"stepquant-{bits}", f"STEPQuant@{bits} plan as calibrated",
         dict(zip(linear_layers, step_codecs, strict=True))),
        (f"temporal-{bits}", f"temporal-only@{bits} plan as calibrated",
         {layer: temporal.codec(i) for i, layer in enumerate(linear_layers)}),
        ("stepquant-bits+absmax", "STEPQuant's bits, absmax quantizer (no column scales, no w)",
         mixed(step, spatial="absmax")),
        ("temporal-bits+dual", "temporal's bits, STEPQuant's dual-axis quantizer (w of the STEPQuant plan)",
         mixed(temporal, w_plan=step)),
        ("stepquant+midtread", "STEPQuant, dual-axis on the midtread grid (zero is a level)",
         mixed(step, grid=Grid.MIDTREAD)),
        ("stepquant+w=1", "STEPQuant, dual-axis without row-impact factors (w = 1)",
         {layer: MixedCodec(bits=step.bits[i], w=None, config=config)
          for i, layer in enumerate(linear_layers)}),
        ("stepquant+w2-refit", "STEPQuant, plain w^2 column refit (not step-normalised)",
         mixed(step, step_normalised_refit=False)),
        ("stepquant+no-refit", "STEPQuant, no column refit (refit_iters = 0)", mixed(step, refit_iters=0)),
        ("stepquant+no-clip", "STEPQuant, no clipping (clip_b = 1 at every width)", mixed(step, clip=1.0)),
        ("stepquant+row-absmax", "STEPQuant, row statistic absmax instead of rms",
         mixed(step, row_stat="absmax")),
    ]
    for i, layer in enumerate(linear_layers):
        for name, codec in ((f"stepquant-{bits}", step_codecs[i]), (f"temporal-{bits}", temporal.codec(i))):
            codecs = {other: codec if other == layer else fp32 for other in linear_layers}
            variants.append((f"{name}@{layer}", f"{name} on layer {layer} only, FP32 elsewhere", codecs))
    return variants


def head_variants(plans: dict, linear_layers: list[int], bits: int,
                  layer: int) -> list[tuple[str, str, dict]]:
    """STEPQuant@b and temporal only@b on one head of one layer: the layer's other heads are stored as
    FP16 pivot rows (bits 16, near-lossless like the FP16 cast), every other layer FP32. Each head is fitted
    on its own, so this isolates the head exactly."""
    if layer not in linear_layers:
        raise ValueError(f"--heads-of-layer must be a linear-attention layer, one of {linear_layers}")
    i = linear_layers.index(layer)
    fp32 = make_codec("fp32")
    variants = []
    for variant in ("stepquant", "temporal"):
        plan = plans[variant]
        codec = plan.codec(i)
        for head in range(plan.bits[i].shape[0]):
            head_bits = torch.full_like(plan.bits[i], 16)
            head_bits[head] = plan.bits[i][head]
            one_head = MixedCodec(bits=head_bits, w=codec.w, spatial=codec.spatial, config=codec.config)
            codecs = {other: one_head if other == layer else fp32 for other in linear_layers}
            variants.append((f"{variant}-{bits}@{layer}.h{head}",
                             f"{variant}-{bits} on head {head} of layer {layer} only", codecs))
    return variants


def run_attribution(model_name: str, bits: int, *, prefill: int, decode: int, window: int, segments: int,
                    data: list[str], plans_dir: Path, threads: int,
                    heads_of_layer: int | None = None) -> dict:
    torch.set_num_threads(threads)
    model, tokenizer = load(model_name)
    linear_layers = list(linear_layers_of(model.config))
    plans = {v: load_plan(plan_path(f"{v}-{bits}", Path(model_name).name, plans_dir), model.config)
             for v in ("stepquant", "temporal")}
    variants = [("fp32", "FP32 reference", dict.fromkeys(linear_layers, make_codec("fp32")))]
    if heads_of_layer is None:
        variants += diagnostic_variants(plans, linear_layers, bits)
    else:
        variants += head_variants(plans, linear_layers, bits, heads_of_layer)
    tokens = torch.cat([cut_segments(d, tokenizer, segments, prefill + decode + 1) for d in data])
    probe = drift_probe(model, tokens, [codecs for _, _, codecs in variants], prefill_len=prefill,
                        window=window, desc=f"{model_name} attribution @{bits}")
    rows = {}
    for m, (name, description, _) in enumerate(variants):
        rows[name] = {
            "description": description,
            "first": float(probe.excess.first[m].mean()),
            "last": float(probe.excess.last[m].mean()),
            "all": float(probe.excess.all[m].mean()),
            "stderr": float(probe.excess.stderr[m]),
            # per-block means (stream-major, blocks of `block` predictions): paired differences between
            # variants (same forward passes) have a smaller standard error than the two ± combined
            "block_means": [round(float(v), 6) for v in probe.excess.block_means[m]],
        }
    return {"model": model_name, "bits": bits, "variants": rows, "seconds": probe.seconds,
            "window": probe.excess.window, "block": probe.excess.block}


def markdown(result: dict, command: str, settings: dict) -> str:
    w = result["window"]
    lines = [
        f"# Error attribution: {result['model']} at {result['bits']} bits",
        "",
        "Generated by `python -m studies.attribution` (studies/attribution.py); rerun:",
        "",
        f"    {command}",
        "",
        f"{settings['date']}, {settings['machine']}; P = {settings['prefill']}, D = {settings['decode']}, "
        f"streams {', '.join(settings['data'])}; decode {result['seconds']['decode']:.0f} s. Excess NLL in "
        f"nats per predicted token vs the FP32 state (mean over streams; ± standard error from blocks of "
        f"{result['block']} predictions).",
        "",
        f"| variant | what it is | first {w} | last {w} | all D |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["variants"].items():
        lines.append(f"| {name} | {row['description']} | {row['first']:+.4f} | {row['last']:+.4f} | "
                     f"{row['all']:+.4f} ± {row['stderr']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.attribution",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="shipped model name (gdn, kda) or a checkpoint")
    parser.add_argument("--bits", type=int, required=True, help="budget whose plans are attributed (4 or 6)")
    parser.add_argument("--quick", action="store_true", help=f"P={QUICK['prefill']}, D={QUICK['decode']}")
    parser.add_argument("--prefill", type=int, default=None)
    parser.add_argument("--decode", type=int, default=None)
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--segments", type=int, default=1)
    parser.add_argument("--data", default=",".join(SHIPPED_STREAMS))
    parser.add_argument("--plans-dir", default=str(DEFAULT_PLANS_DIR),
                        help="plans/<model>/<variant>-<bits>/ or a `stepquant calibrate --out` folder")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads-of-layer", type=int, default=None, metavar="LAYER",
                        help="instead of the standard variants: each head of this layer on its own")
    parser.add_argument("--out", default="eval_results")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    prefill = args.prefill or defaults["prefill"]
    decode = args.decode or defaults["decode"]
    data = [d for d in args.data.split(",") if d]
    started = time.perf_counter()
    result = run_attribution(args.model, args.bits, prefill=prefill, decode=decode, window=args.window,
                             segments=args.segments, data=data, plans_dir=Path(args.plans_dir),
                             threads=args.threads, heads_of_layer=args.heads_of_layer)
    settings = {"prefill": prefill, "decode": decode, "data": data, "machine": machine(),
                "date": datetime.date.today().isoformat(), "seconds": time.perf_counter() - started}
    command = "python -m studies.attribution " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"attribution_{Path(args.model).name}_{args.bits}"
    if args.heads_of_layer is not None:
        stem += f"_layer{args.heads_of_layer}_heads"
    record = {**result, "settings": settings, "command": command}
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    text = markdown(result, command, settings)
    (out / f"{stem}.md").write_text(text)
    print(text)
    summary = {name: round(row["all"], 5) for name, row in result["variants"].items()}
    print(json.dumps({"model": args.model, "bits": args.bits, "seconds": round(settings["seconds"], 1),
                      "excess_nll_all": summary}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

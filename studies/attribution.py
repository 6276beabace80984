"""Error attribution: where a STEPQuant variant's excess NLL comes from (docs/eval.md section 4).

Runs the drift probe of `stepquant eval` (one FP32 prefill per stream, every variant in one batched decode
loop) on diagnostic variants built from a model's calibrated plans at one budget b:

- per layer: STEPQuant@b and temporal only@b on one linear-attention layer, FP32 elsewhere;
- quantizer swaps with the bits held fixed: STEPQuant's bit plan under the absmax quantizer (temporal-only
  quantizer), temporal's bit plan under the dual-axis quantizer, and STEPQuant's dual-axis quantizer with
  one knob changed at a time (midtread grid, w = 1, the plain w^2 refit, no refit, no clipping, absmax row
  statistic);
- with ``--heads-of-layer L``: STEPQuant@b and temporal only@b on each head of layer L on its own;
- with ``--memory``: how much the model reads its recurrent state (issue 14 item 0): the state zeroed at the
  prefill/decode boundary (every unit; the long-lived quarter), units made memoryless (zeroed at every
  store: every unit, and each lifetime class by the calibrated half-life rank within its layer), and
  INT-b on one lifetime class only with FP16 elsewhere;
- with ``--pivots``: what FP16 pivots can protect. Uniform INT-b (rowwise absmax) everywhere, with the
  P units of highest calibrated risk lambda_u d_u(b) (P = the plan's pivot count, the paper's share),
  the top 4P and the top 16P stored as FP16 instead, the 16P lowest-risk units as a control, and 16P
  units chosen by lambda d omega (risk weighted by the readout impact) and by d alone; the record also
  gets each plan's risk table (:func:`pivot_risk`): the pivots' share of the total risk and what they
  would add to the plan's objective at 8 bits.

    python -m studies.attribution --model kda --bits 4 --quick --out docs/results
    python -m studies.attribution --model gdn --bits 4 --quick --pivots --out docs/results
    python -m studies.attribution --model kda --bits 4 --quick --memory --out docs/results

Writes attribution_<model>_<bits>[_pivots|_memory].json and .md into --out, prints the table and one JSON
line last.
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

from stepquant.analysis.mechanisms import LIFETIME_CLASSES, lifetime_classes
from stepquant.cli import check_device
from stepquant.codecs import Grid, MixedCodec, make_codec
from stepquant.codecs.base import MIN_BITS, PIVOT_BITS, Codec, as_fp32
from stepquant.data import segments as cut_segments
from stepquant.eval.methods import DEFAULT_PLANS_DIR, load_plan, plan_path
from stepquant.eval.probe import drift_probe
from stepquant.eval.report import paired_difference
from stepquant.eval.run import machine
from stepquant.eval.settings import DEFAULT_WINDOW, FULL, QUICK, SHIPPED_STREAMS
from stepquant.families import linear_layers as linear_layers_of
from stepquant.models import load


def diagnostic_variants(plans: dict, linear_layers: list[int], bits: int,
                        recalibrated=None, per_layer: bool = True) -> list[tuple[str, str, dict]]:
    """(name, description, {model layer: codec}) of every diagnostic variant; plans = {variant: Plan}.

    recalibrated: a STEPQuant@b plan calibrated under another quantizer (its own d_u(b) table, bits and w),
    evaluated as calibrated next to the shipped plan's single-knob swaps. per_layer=False leaves out the
    one-layer-only rows (half the variants).
    """
    step, temporal = plans["stepquant"], plans["temporal"]
    fp32 = make_codec("fp32")
    uniform = make_codec(f"int{bits}")
    step_codecs = [step.codec(i) for i in range(len(linear_layers))]
    config = step_codecs[0].config
    other = Grid.MIDRISE if config.grid is Grid.MIDTREAD else Grid.MIDTREAD  # the grid the plan does not use

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
        (f"stepquant+{other.value}",
         f"STEPQuant, dual-axis on the {other.value} grid (plan: {config.grid.value})",
         mixed(step, grid=other)),
        ("stepquant+w=1", "STEPQuant, dual-axis without row-impact factors (w = 1)",
         {layer: MixedCodec(bits=step.bits[i], w=None, config=config)
          for i, layer in enumerate(linear_layers)}),
        ("stepquant+w2-refit", "STEPQuant, plain w^2 column refit (not step-normalised)",
         mixed(step, step_normalised_refit=False)),
    ]
    variants += [(f"stepquant+refit={n}", f"STEPQuant, {n} column refit(s) (plan: {config.refit_iters})",
                  mixed(step, refit_iters=n)) for n in (0, 1, 2) if n != config.refit_iters]
    variants += [
        ("stepquant+no-clip", "STEPQuant, no clipping (clip_b = 1 at every width)", mixed(step, clip=1.0)),
        ("stepquant+row-absmax", f"STEPQuant, row statistic absmax (plan: {config.row_stat})",
         mixed(step, row_stat="absmax")),
        ("stepquant+row-meanabs",
         f"STEPQuant, row statistic mean_abs, the mean magnitude (plan: {config.row_stat})",
         mixed(step, row_stat="mean_abs")),
        (f"stepquant+{other.value}+row-absmax", f"STEPQuant, {other.value} grid and absmax row statistic",
         mixed(step, grid=other, row_stat="absmax")),
    ]
    if recalibrated is not None:
        q = recalibrated.codec(0).config
        what = f"grid {q.grid.value}, row stat {q.row_stat}, {q.refit_iters} refit(s)"
        variants.append(("stepquant-recalibrated",
                         f"STEPQuant@{bits} recalibrated under {what} (its own d_u(b), bits and w)",
                         {layer: recalibrated.codec(i) for i, layer in enumerate(linear_layers)}))
    for i, layer in enumerate(linear_layers if per_layer else []):
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


def _unit_risk(plan, bits: int) -> torch.Tensor:
    """lambda_u d_u(bits) of every unit [U] (flat, layer-major) from a plan's calibration tables."""
    return (plan.lifetime.double() * plan.distortion.double()[..., bits - MIN_BITS]).flatten()


def _unit_bits(plan) -> torch.Tensor:
    """The plan's width of every unit [U] (a GDN head's rows share one width), flat, layer-major."""
    bits = torch.stack(list(plan.bits)).to(torch.int64)  # [L, H, K]
    return (bits[..., 0] if plan.lifetime.dim() == 2 else bits).flatten()


def pivot_risk(plan) -> dict:
    """The risk lambda_u d_u(b̄) of a plan's FP16 pivots against the other units (calibration tables).

    risk_share: the pivots' part of sum_u lambda_u d_u(b̄); top_share: the same for the top P, 4P, 16P
    units by risk; objective: sum over integer units of lambda_u d_u(b_u) (the plan's allocation);
    pivots_at_8: what the pivots would add to it stored at 8 bits instead of FP16."""
    b = plan.budget_bits
    risk, widths = _unit_risk(plan, b), _unit_bits(plan)
    distortion = plan.distortion.double().reshape(len(risk), -1)
    lifetime = plan.lifetime.double().flatten()
    pivots = widths == PIVOT_BITS
    integer = torch.nonzero(~pivots).flatten()
    objective = float((lifetime[integer] * distortion[integer, widths[integer] - MIN_BITS]).sum())
    at_8 = float((lifetime[pivots] * distortion[pivots, 8 - MIN_BITS]).sum())
    order = torch.argsort(-risk, stable=True)
    count = int(pivots.sum())
    total = float(risk.sum())
    half_lives = plan.half_lives.double().flatten()
    return {
        "plan": f"{plan.variant}-{b}", "units": len(risk), "pivots": count,
        "pivot_risk": float(risk[pivots].sum()), "total_risk": total,
        "median_unit_risk": float(risk.median()),
        "risk_share": float(risk[pivots].sum()) / total,
        "top_share": {f"{k}P": float(risk[order[:k * count]].sum()) / total for k in (1, 4, 16)},
        "objective": objective, "pivots_at_8": at_8,
        "pivot_half_lives": [round(float(h), 1) for h in half_lives[pivots]],
        "median_half_life": float(half_lives.median()),
    }


def pivot_variants(plans: dict, linear_layers: list[int], bits: int) -> list[tuple[str, str, dict]]:
    """INT-b everywhere with FP16 pivots on the top P / 4P / 16P units by risk lambda_u d_u(b) and on the
    16P lowest-risk units (P = the temporal plan's pivot count; d under rowwise absmax, the format here)."""
    plan = plans["temporal"]
    risk = _unit_risk(plan, bits)
    count = int(plan.pivots)
    if count < 1:
        raise ValueError(f"the {plan.variant}-{bits} plan has no pivots to compare")
    order = torch.argsort(-risk, stable=True)
    shape = torch.stack(list(plan.bits)).shape  # [L, H, K]
    per_head = plan.lifetime.dim() == 2  # GDN: a unit is a head

    def with_pivots(units: torch.Tensor) -> dict:
        table = torch.full(shape, bits, dtype=torch.int8)
        mask = torch.zeros(len(risk), dtype=torch.bool)
        mask[units] = True
        mask = mask.reshape(shape[:2] if per_head else shape)
        table[mask[..., None].expand(shape) if per_head else mask] = PIVOT_BITS
        return {layer: MixedCodec(bits=table[i], w=plan.w[i], spatial="absmax")
                for i, layer in enumerate(linear_layers)}

    unit = "heads" if per_head else "rows"
    variants = [(f"int{bits}", f"INT{bits} rowwise absmax, every unit",
                 dict.fromkeys(linear_layers, make_codec(f"int{bits}")))]
    for k in (1, 4, 16):
        top = order[:k * count]
        share = float(risk[top].sum() / risk.sum())
        variants.append((f"int{bits}+top{k}P", f"INT{bits}, the {k * count} highest-risk {unit} FP16 "
                         f"({share:.0%} of the risk)", with_pivots(top)))
    low = order[-16 * count:]
    variants.append((f"int{bits}+low16P", f"INT{bits}, the {16 * count} lowest-risk {unit} FP16 "
                     f"({float(risk[low].sum() / risk.sum()):.1%} of the risk)", with_pivots(low)))
    # other selections of 16P units: impact-weighted risk (lambda d omega, omega the readout weight
    # E[(A^T q)_i^2] of docs/method.md, a head's mean for GDN), and distortion alone (no lifetime)
    omega = plan.omega.double()
    omega = (omega.mean(-1) if per_head else omega).flatten()
    distortion = plan.distortion.double()[..., bits - MIN_BITS].flatten()
    for tag, score, what in (("impact16P", risk * omega, "lambda d omega"), ("d16P", distortion, "d alone")):
        chosen = torch.argsort(-score, stable=True)[:16 * count]
        share = float(risk[chosen].sum() / risk.sum())
        variants.append((f"int{bits}+{tag}", f"INT{bits}, the {16 * count} {unit} of highest {what} FP16 "
                         f"({share:.0%} of the risk)", with_pivots(chosen)))
    return variants


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroUnits(Codec):
    """Diagnostic state format (--memory): FP32, with the units where ``keep`` [H, K] is 0 stored as zeros.

    once=False zeroes them at every store (each such unit holds only the current token's write: no memory);
    once=True only at the first store, the prefill/decode boundary (the units forget the prompt, then run
    in FP32). Not a compression format: it measures how much the next tokens depend on the state."""

    keep: torch.Tensor
    once: bool = False
    name: str = "zero-units"

    @property
    def carries_residual(self) -> bool:  # once: later stores go through requantize (no zeroing)
        return self.once

    def encode(self, states: torch.Tensor) -> torch.Tensor:
        return as_fp32(states) * self.keep.to(states.device, torch.float32)[None, :, :, None]

    def requantize(self, states: torch.Tensor, previous) -> torch.Tensor:
        return as_fp32(states).clone() if self.once else self.encode(states)

    def decode(self, encoded: torch.Tensor) -> torch.Tensor:
        return encoded

    def storage_bits(self, num_heads: int, key_dim: int, value_dim: int, *, analytical: bool = False) -> int:
        return 32 * num_heads * key_dim * value_dim


# what the rows say of each of mechanisms.LIFETIME_CLASSES (lifetime_classes 0, 1, 2)
CLASS_WORDS = {"short": "short-lived quarter", "middle": "middle half", "long": "long-lived quarter"}


def memory_variants(plans: dict, linear_layers: list[int], bits: int) -> list[tuple[str, str, dict]]:
    """How much the model reads its recurrent state (see the module docstring); lifetime classes from the
    temporal plan's calibrated half-lives, ranked within each layer (a GDN head or a KDA key row per unit)."""
    plan = plans["temporal"]
    shape = torch.stack(list(plan.bits)).shape  # [L, H, K]
    classes = lifetime_classes(plan.half_lives)  # [L, H] (GDN) or [L, H, K] (KDA)
    if classes.dim() == 2:
        classes = classes[..., None].expand(shape)
    layers = list(enumerate(linear_layers))

    def zero(selected: torch.Tensor, once: bool) -> dict:
        return {layer: ZeroUnits(keep=(~selected[i]).float(), once=once) for i, layer in layers}

    def int_on(selected: torch.Tensor) -> dict:
        table = torch.where(selected, bits, PIVOT_BITS).to(torch.int8)
        return {layer: MixedCodec(bits=table[i], spatial="absmax") for i, layer in layers}

    every, long = torch.ones(shape, dtype=torch.bool), classes == 2
    variants = [
        (f"int{bits}", f"INT{bits} rowwise absmax, every unit",
         dict.fromkeys(linear_layers, make_codec(f"int{bits}"))),
        ("forget-prompt", "every unit zeroed at the prefill/decode boundary, FP32 after", zero(every, True)),
        ("forget-prompt-long", "the long-lived quarter zeroed at the boundary, FP32 after", zero(long, True)),
        ("memoryless", "every unit zeroed at every store (the attention layers keep the context)",
         zero(every, False)),
    ]
    variants += [(f"memoryless-{label}", f"the {CLASS_WORDS[label]} of each layer zeroed at every store, "
                  "FP32 else", zero(classes == c, False)) for c, label in enumerate(LIFETIME_CLASSES)]
    variants += [(f"int{bits}-{label}", f"INT{bits} rowwise absmax on the {CLASS_WORDS[label]}, FP16 "
                  "elsewhere", int_on(classes == c)) for c, label in enumerate(LIFETIME_CLASSES)]
    return variants


def run_attribution(model_name: str, bits: int, *, prefill: int, decode: int, window: int, segments: int,
                    data: list[str], plans_dir: Path, threads: int,
                    heads_of_layer: int | None = None, pivots: bool = False, memory: bool = False,
                    recalibrated_dir: Path | None = None, per_layer: bool = True,
                    device: str = "cpu", only: list[str] | None = None) -> dict:
    torch.set_num_threads(threads)
    model, tokenizer = load(model_name, device=device)
    linear_layers = list(linear_layers_of(model.config))
    plans = {v: load_plan(plan_path(f"{v}-{bits}", Path(model_name).name, plans_dir), model.config)
             for v in ("stepquant", "temporal")}
    recalibrated = None if recalibrated_dir is None else load_plan(
        plan_path(f"stepquant-{bits}", Path(model_name).name, recalibrated_dir), model.config)
    variants = [("fp32", "FP32 reference", dict.fromkeys(linear_layers, make_codec("fp32")))]
    if pivots:
        variants += pivot_variants(plans, linear_layers, bits)
    elif memory:
        variants += memory_variants(plans, linear_layers, bits)
    elif heads_of_layer is None:
        variants += diagnostic_variants(plans, linear_layers, bits, recalibrated, per_layer)
    else:
        variants += head_variants(plans, linear_layers, bits, heads_of_layer)
    if only is not None:
        known = [name for name, _, _ in variants]
        unknown = sorted(set(only) - set(known))
        if unknown:
            raise ValueError(f"--only: no variant named {unknown}; the variants are {known}")
        keep = {"fp32", f"int{bits}", f"stepquant-{bits}", *only}
        variants = [v for v in variants if v[0] in keep]
    tokens = torch.cat([cut_segments(d, tokenizer, segments, prefill + decode + 1) for d in data])
    tokens = tokens.to(model.get_input_embeddings().weight.device)
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
    result = {"model": model_name, "bits": bits, "variants": rows, "seconds": probe.seconds,
              "window": probe.excess.window, "block": probe.excess.block}
    if pivots:
        result["pivot_risk"] = [pivot_risk(plans[v]) for v in ("stepquant", "temporal")]
    return result


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
    # paired differences to the pivots' uniform INT-b, or to the shipped STEPQuant@b plan for its swaps
    swaps = any(name.startswith("stepquant+") or name == "stepquant-recalibrated"
                for name in result["variants"])
    base_name = (f"int{result['bits']}" if "pivot_risk" in result
                 else f"stepquant-{result['bits']}" if swaps else None)
    base = result["variants"].get(base_name)
    if base is not None:
        lines[-2] += f" difference to {base_name} (paired) |"
        lines[-1] += "---|"
    for name, row in result["variants"].items():
        line = (f"| {name} | {row['description']} | {row['first']:+.4f} | {row['last']:+.4f} | "
                f"{row['all']:+.4f} ± {row['stderr']:.4f} |")
        if base is not None:
            paired = (paired_difference({"excess_nll": row}, {"excess_nll": base})
                      if row is not base and len(base["block_means"]) >= 2 else None)
            line += " - |" if paired is None else f" {paired['diff']:+.4f} ± {paired['se']:.4f} |"
        lines.append(line)
    if "pivot_risk" in result:
        lines += ["", "Calibrated risk lambda_u d_u(b̄) of each plan's FP16 pivots against the other units "
                  "(the plans' own lifetime and distortion tables, H = 2,048): their share of the total "
                  "risk, the share of the top P / 4P / 16P units, and what the pivots would add to the "
                  "plan's objective sum lambda_u d_u(b_u) (integer units) if stored at 8 bits.", "",
                  "| plan | units | pivots | pivot half-lives (median unit) | pivot risk share | "
                  "top P / 4P / 16P share | objective | pivots at 8 bits |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["pivot_risk"]:
            lives = ", ".join(f"{h:,.0f}" for h in r["pivot_half_lives"][:6])
            lives += ", ..." if len(r["pivot_half_lives"]) > 6 else ""
            top = " / ".join(f"{v:.0%}" for v in r["top_share"].values())
            lines.append(f"| {r['plan']} | {r['units']:,} | {r['pivots']} | {lives} "
                         f"({r['median_half_life']:.0f}) | {r['risk_share']:.0%} | {top} | "
                         f"{r['objective']:.4g} | +{r['pivots_at_8']:.4g} "
                         f"(+{r['pivots_at_8'] / r['objective']:.0%}) |")
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
    parser.add_argument("--device", default="cpu", help="device of the model and the probe (cpu, cuda)")
    parser.add_argument("--recalibrated", default=None, metavar="DIR",
                        help="also evaluate the stepquant-<bits> plan of this `stepquant calibrate --out` "
                             "folder (e.g. calibrated with --grid midtread) beside the shipped plan's swaps")
    parser.add_argument("--heads-of-layer", type=int, default=None, metavar="LAYER",
                        help="instead of the standard variants: each head of this layer on its own")
    parser.add_argument("--pivots", action="store_true",
                        help="instead of the standard variants: INT-b with FP16 pivots on the top P / 4P / "
                             "16P units by calibrated risk and on the 16P lowest-risk units, plus the risk "
                             "tables")
    parser.add_argument("--memory", action="store_true",
                        help="instead of the standard variants: how much the model reads its state "
                             "(units zeroed at the boundary or at every store, by lifetime class; INT-b "
                             "on one class)")
    parser.add_argument("--no-per-layer", action="store_true",
                        help="leave out the one-layer-only rows (the quantizer swaps only: half the time)")
    parser.add_argument("--only", default=None, metavar="NAMES",
                        help="comma list of variant names to keep (fp32, int<b>, stepquant-<b> always "
                        "stay): a cheaper probe of a few swaps")
    parser.add_argument("--tag", default=None,
                        help="appended to the file stem (attribution_<model>_<bits>[_swaps]_<tag>)")
    parser.add_argument("--out", default="eval_results")
    args = parser.parse_args(argv)
    if args.pivots + args.memory + (args.heads_of_layer is not None) > 1:
        parser.error("give one of --pivots, --memory and --heads-of-layer")
    if args.recalibrated is not None and (args.pivots or args.memory or args.heads_of_layer is not None):
        parser.error("--recalibrated adds to the standard variants: not with --pivots, --memory or "
                     "--heads-of-layer")
    try:
        check_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    defaults = QUICK if args.quick else FULL
    prefill = args.prefill or defaults["prefill"]
    decode = args.decode or defaults["decode"]
    data = [d for d in args.data.split(",") if d]
    started = time.perf_counter()
    result = run_attribution(args.model, args.bits, prefill=prefill, decode=decode, window=args.window,
                             segments=args.segments, data=data, plans_dir=Path(args.plans_dir),
                             threads=args.threads, heads_of_layer=args.heads_of_layer, pivots=args.pivots,
                             memory=args.memory,
                             recalibrated_dir=None if args.recalibrated is None else Path(args.recalibrated),
                             per_layer=not args.no_per_layer, device=args.device,
                             only=None if args.only is None else [n for n in args.only.split(",") if n])
    settings = {"prefill": prefill, "decode": decode, "data": data, "machine": machine(),
                "date": datetime.date.today().isoformat(), "seconds": time.perf_counter() - started}
    command = "python -m studies.attribution " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"attribution_{Path(args.model).name}_{args.bits}"
    if args.heads_of_layer is not None:
        stem += f"_layer{args.heads_of_layer}_heads"
    if args.pivots:
        stem += "_pivots"
    if args.memory:
        stem += "_memory"
    if args.no_per_layer:
        stem += "_swaps"
    if args.tag:
        stem += f"_{args.tag}"
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

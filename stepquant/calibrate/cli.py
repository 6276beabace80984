"""`stepquant calibrate`: calibration statistics of a model, then one plan per (variant, budget) from them.

    stepquant calibrate --model gdn --bits 4,6 --variant all --out plans/gdn

runs the model once over the calibration text (two streamed passes, see stats.py), writes
``DIR/stats.safetensors``, and for every variant and budget a plan directory ``DIR/<variant>-<bits>/``
(plan.json, plan.safetensors, half_life_vs_bits.png). ``--stats DIR`` reuses saved statistics and
makes plans without running the model again. A summary table per plan is printed, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import time
from pathlib import Path

import torch

from stepquant.codecs.base import Grid
from stepquant.codecs.dual_axis import (
    DEFAULT_DIVISION,
    DEFAULT_GRID,
    DEFAULT_REFIT_ITERS,
    DEFAULT_ROW_STAT,
    DIVISIONS,
    ROW_STATS,
    DualAxisConfig,
)
from stepquant.families import KDA, family_for

from .allocate import (
    DEFAULT_HORIZON,
    VARIANTS,
    allocate,
    check_candidates,
    default_candidates,
    lifetime_weights,
)
from .plan import PLAN_PLOT, Plan, build_plan, model_shape
from .stats import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_EXPONENT,
    DEFAULT_OMEGA_FLOOR,
    DEFAULT_SNAPSHOT_EVERY,
    STATS_FILE,
    CalibrationStats,
    StatsConfig,
    collect_stats,
)

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated ints, got {text!r}") from None
    if not values:
        raise ValueError(f"{name} must list at least one int, got {text!r}")
    return values


def _variants(text: str) -> list[str]:
    names = list(VARIANTS) if text.strip() == "all" else [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"--variant must be 'all' or a comma list of {', '.join(VARIANTS)}, got {text!r}")
    return names


def plot_half_life_vs_bits(plan: Plan, path: str | Path) -> Path:
    """Scatter of every unit's half-life (log axis) against its allocated bits; pivots on an "FP16" row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tau = plan.half_lives.reshape(-1).clamp(max=1e9).numpy()
    bits = plan.unit_bits.reshape(-1).to(torch.float64)
    pivot_row = max(plan.candidates) + 1.5
    y = torch.where(bits == 16, torch.full_like(bits, pivot_row), bits)
    layer = torch.arange(len(plan.linear_layers)).repeat_interleave(math.prod(plan.unit_shape[1:]))
    if plan.family == "kda":  # thousands of rows share a few widths: a little vertical jitter
        noise = torch.rand(y.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        y = y + (noise - 0.5) * 0.4
    figure = Figure(figsize=(7, 4.2), dpi=90)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    points = axes.scatter(
        tau,
        y.numpy(),
        c=layer.numpy(),
        cmap="viridis",
        s=4 if plan.family == "kda" else 28,
        alpha=0.6 if plan.family == "kda" else 0.7,
        linewidths=0,
    )
    axes.set_xscale("log")
    ticks = sorted(set(plan.candidates) | {plan.budget_bits})
    axes.set_yticks(
        ticks + ([pivot_row] if plan.pivots else []),
        [str(b) for b in ticks] + (["FP16"] if plan.pivots else []),
    )
    axes.set_xlabel("gate half-life (tokens)")
    axes.set_ylabel("allocated bits")
    unit = "head" if plan.family == "gdn" else "key row"
    axes.set_title(
        f"{plan.model_name or plan.model_type}: {plan.variant} @ {plan.budget_bits} bits "
        f"({plan.bits_per_value(serving=True):.3f} bits/value served), one dot per {unit}",
        fontsize=9,
    )
    colorbar = figure.colorbar(points, ax=axes)
    colorbar.set_label("linear layer number")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path)
    return path


def format_plan_summary(plan: Plan, top: int = 5) -> str:
    """The table printed for a plan: budget vs achieved, bits histogram, pivots, longest-lived units."""
    acc = plan.accounting()
    summary = plan.summary
    unit = "head" if plan.family == "gdn" else "key row"
    lines = [
        f"{plan.variant} @ {plan.budget_bits} bits: {plan.model_name or plan.model_type} ({plan.model_type}, "
        f"{plan.family.upper()}, {len(plan.linear_layers)} linear layers x {plan.num_heads} heads of "
        f"{plan.key_dim}x{plan.value_dim}; unit = {unit}, {summary.get('num_units')} units)",
        f"  budget   code bits {acc['code_bits_budget']:,} (= {plan.budget_bits} N - 8 x {plan.pivots} pivot "
        f"{unit}s), used {acc['code_bits_used']:,}, slack {acc['slack_bits']:,} bits",
        f"  bytes    {acc['analytical_bytes']:,} analytical / {acc['serving_bytes']:,} serving "
        f"(nominal {acc['nominal_analytical_bytes']:,} / {acc['nominal_serving_bytes']:,}), "
        f"FP32 {acc['fp32_bytes']:,}",
        f"  bits/value {acc['bits_per_value']:.4f} analytical, {acc['serving_bits_per_value']:.4f} serving "
        f"(budget {plan.budget_bits} + scales); {acc['serving_ratio_vs_fp32']:.2f}x vs FP32",
        "  histogram " + "  ".join(f"{b}: {n}" for b, n in summary["bits_histogram"].items()),
    ]
    pivots = summary.get("pivot_units", [])
    if pivots:
        shown = ", ".join(_unit_text(p) + f" (tau {p['half_life']:g})" for p in pivots[:top])
        lines.append(f"  pivots   {len(pivots)}: {shown}{', ...' if len(pivots) > top else ''}")
    quartiles = summary.get("mean_bits_by_half_life_quartile", {})
    lines.append(
        "  mean bits by half-life quarter (short -> long): "
        + " / ".join("-" if v is None else f"{v:.2f}" for v in quartiles.values())
    )
    hl = summary.get("half_life_tokens", {})
    above = summary.get("half_life_above", {})
    lines.append(
        f"  half-life tokens: median {hl.get('p50')}, p90 {hl.get('p90')}, max {hl.get('max')}; "
        + ", ".join(f"> {k}: {v}" for k, v in above.items())
    )
    lines.append(
        "  longest-lived: "
        + ", ".join(
            f"{_unit_text(u)} tau {u['half_life']:g} -> {'FP16' if u['bits'] == 16 else str(u['bits']) + 'b'}"
            for u in summary.get("longest_lived", [])[:top]
        )
    )
    distortion = summary.get("lifetime_weighted_distortion", {})
    if distortion.get("ratio") is not None:
        lines.append(
            f"  lifetime-weighted distortion vs uniform {plan.budget_bits} bits: x{distortion['ratio']:.3f}"
        )
    return "\n".join(lines)


def _unit_text(unit: dict) -> str:
    return f"L{unit['layer']}.h{unit['head']}" + (f".r{unit['row']}" if "row" in unit else "")


def _quantizer_options(args) -> list[str]:
    """The quantizer's options of the command line, where they differ from the defaults."""
    parts = ["--grid", args.grid] if args.grid != DEFAULT_GRID.value else []
    if args.row_stat != DEFAULT_ROW_STAT:
        parts += ["--row-stat", args.row_stat]
    if args.division != DEFAULT_DIVISION:
        parts += ["--division", args.division]
    if args.refit_iters != DEFAULT_REFIT_ITERS:
        parts += ["--refit-iters", str(args.refit_iters)]
    if args.row_fill:
        parts += ["--row-fill"]
    return parts


def _stats_command(args) -> str:
    parts = [
        "stepquant calibrate",
        "--model",
        shlex.quote(str(args.model)),
        "--segments",
        str(args.segments),
        "--segment-length",
        str(args.segment_length),
        "--data",
        shlex.quote(str(args.data)),
        "--dtype",
        args.dtype,
        "--snapshot-every",
        str(args.snapshot_every),
    ]
    if args.exponent is not None:
        parts += ["--exponent", repr(args.exponent)]
    if args.omega_floor is not None:
        parts += ["--omega-floor", repr(args.omega_floor)]
    if args.device_map:
        parts += ["--device-map", args.device_map]
    parts += _quantizer_options(args)
    return " ".join(parts)


def _plan_command(args, variant: str, bits: int) -> str:
    source = f"--stats {shlex.quote(str(args.stats))}" if args.stats else None
    parts = ["stepquant calibrate", source] if source else [_stats_command(args)]
    parts += ["--bits", str(bits), "--variant", variant, "--horizon", str(args.horizon)]
    if args.pivots is not None:
        parts += ["--pivots", str(args.pivots)]
    if args.candidates:
        parts += ["--candidates", args.candidates]
    if args.stats:
        parts += _quantizer_options(args)
    parts += ["--out", shlex.quote(str(args.out))]
    return " ".join(parts)


def _load_stats(args) -> CalibrationStats:
    path = Path(args.stats)
    stats = CalibrationStats.load(path)
    for flag, value, recorded in (
        ("--exponent", args.exponent, stats.exponent),
        ("--omega-floor", args.omega_floor, stats.omega_floor),
    ):
        if value is not None and value != recorded:
            raise ValueError(
                f"{flag} {value} differs from the statistics in {path} ({recorded}); the dual-axis "
                "distortion depends on it: recalibrate without --stats"
            )
    if args.model is not None:
        model = model_shape(args.model)
        if model.model_type != stats.model_type or model.layer_indices != stats.linear_layers:
            raise ValueError(
                f"the statistics in {path} are for {stats.model_type} layers "
                f"{list(stats.linear_layers)}, not for --model {args.model}"
            )
    return stats


def _quantizer(args) -> DualAxisConfig:
    """The dual-axis quantizer the distortion table is measured with and the plans record."""
    if args.refit_iters < 0:
        raise ValueError(f"--refit-iters must be >= 0, got {args.refit_iters}")
    if args.row_fill and args.division != "reciprocal":
        raise ValueError("--row-fill needs --division reciprocal (the rows are rescaled from the Y the "
                         "kernels hold)")
    return DualAxisConfig(grid=args.grid, row_stat=args.row_stat, division=args.division,
                          refit_iters=args.refit_iters, row_fill=args.row_fill)


def _stats_config(args) -> StatsConfig:
    """The statistics' settings, validated (before the model runs)."""
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if args.segments < 1 or args.segment_length < 2:
        raise ValueError(f"need --segments >= 1 and --segment-length >= 2, got {args.segments} and "
                         f"{args.segment_length}")
    if not 1 <= args.snapshot_every <= args.segment_length:
        raise ValueError(f"--snapshot-every must be in 1..--segment-length ({args.segment_length}), got "
                         f"{args.snapshot_every}: the distortion is measured on state snapshots")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    return StatsConfig(
        snapshot_every=args.snapshot_every,
        exponent=DEFAULT_EXPONENT if args.exponent is None else args.exponent,
        omega_floor=DEFAULT_OMEGA_FLOOR if args.omega_floor is None else args.omega_floor,
        batch_size=args.batch_size,
        replay_device=args.replay_device,
        quantizer=_quantizer(args),
    )


def _check_model_inputs(args) -> None:
    """The model, its data and its devices exist (before the model is loaded)."""
    from stepquant.cli import check_device
    from stepquant.data import check_source
    from stepquant.models import model_type

    family_for(model_type(args.model))
    check_source(args.data)
    if args.device_map is None:
        check_device(args.device)
    check_device(args.replay_device, "--replay-device")


def _check_targets(out: Path, targets: list[Path], force: bool) -> None:
    """Refuse to overwrite an earlier calibration's statistics or plans in --out without --force."""
    taken = [t for t in targets if t.is_file() or (t.is_dir() and any(t.iterdir()))]
    if taken and not force:
        names = ", ".join(t.name + ("/" if t.is_dir() else "") for t in taken)
        raise ValueError(f"--out {out} already holds {names} (an earlier calibration): give a new --out "
                         "directory, or --force to replace them")


def _collect(args, config: StatsConfig) -> CalibrationStats:
    from stepquant.data import segments
    from stepquant.models import load, model_type

    on_cpu = (args.device_map is None and str(args.device).startswith("cpu")) or (
        args.device_map is not None and not torch.cuda.is_available()
    )
    # On CPU transformers' chunked torch fallback is the faster prefill for GDN, its token loop for KDA
    # (stepquant.models.use_recurrent_prefill); on GPU the model's own kernels are kept.
    token_loop = on_cpu and family_for(model_type(args.model)) is KDA
    model, tokenizer = load(
        args.model,
        dtype=DTYPES[args.dtype],
        device=args.device,
        device_map=args.device_map,
        recurrent_prefill=token_loop,
    )
    tokens = segments(args.data, tokenizer, args.segments, args.segment_length)
    stats = collect_stats(
        model, tokens, config, model_name=str(args.model), data=str(args.data), progress=not args.no_progress
    )
    stats.settings["stats_command"] = _stats_command(args)
    stats.settings["device_map"] = args.device_map
    return stats


def run_calibrate(args: argparse.Namespace) -> int:
    bits_list = _int_list(args.bits, "--bits")
    variants = _variants(args.variant)
    candidates = _int_list(args.candidates, "--candidates") if args.candidates else None
    if args.stats is None and args.model is None:
        raise ValueError("give --model PATH_OR_SHIPPED_NAME (or --stats DIR to reuse saved statistics)")
    # fail on a bad budget / candidate set / horizon / pivot count before the model runs, not after
    for bits in bits_list:
        default_candidates(bits)
    if candidates is not None:
        check_candidates(candidates)
    lifetime_weights(torch.zeros(1), args.horizon)
    if args.pivots is not None and args.pivots < 0:
        raise ValueError(f"--pivots must be >= 0, got {args.pivots}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    from stepquant.cli import check_output_dir

    started = time.perf_counter()
    if args.stats is not None:
        stats = _load_stats(args)
    else:
        config = _stats_config(args)
        _check_model_inputs(args)
    out = check_output_dir(args.out)
    plan_dirs = [out / f"{variant}-{bits}" for variant in variants for bits in bits_list]
    _check_targets(out, plan_dirs + ([] if args.stats is not None else [out / STATS_FILE]), args.force)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.stats is not None:
        stats_path = Path(args.stats)
    else:
        stats = _collect(args, config)
        stats_path = stats.save(out)
    calibration_seconds = time.perf_counter() - started
    records = []
    for variant in variants:
        for bits in bits_list:
            pivots = args.pivots if VARIANTS[variant].pivots else None
            plan_candidates = candidates if VARIANTS[variant].mixed else None
            allocation = allocate(
                stats, variant, bits, pivots=pivots, candidates=plan_candidates, horizon=args.horizon
            )
            plan = build_plan(stats, allocation, command=_plan_command(args, variant, bits),
                              quantizer=_quantizer(args))
            directory = plan.save(out / f"{variant}-{bits}")
            plan = Plan.load(directory, model_config=args.model)  # what a consumer will read, verified
            accounting = plan.accounting()
            if accounting["slack_bits"] < 0:
                raise RuntimeError(
                    f"{directory}: the plan exceeds its budget by {-accounting['slack_bits']} bits"
                )
            plot_half_life_vs_bits(plan, directory / PLAN_PLOT)
            if not args.json:
                print(format_plan_summary(plan))
                print(f"  -> {directory}")
                print()
            records.append(
                {
                    "plan": str(directory),
                    "variant": variant,
                    "bits": bits,
                    "pivots": plan.pivots,
                    "bits_per_value": round(accounting["bits_per_value"], 6),
                    "serving_bits_per_value": round(accounting["serving_bits_per_value"], 6),
                    "serving_bytes": accounting["serving_bytes"],
                    "slack_bits": accounting["slack_bits"],
                    "histogram": plan.summary["bits_histogram"],
                }
            )
    result = {
        "model": stats.model_name or stats.model_type,
        "model_type": stats.model_type,
        "stats": str(stats_path),
        "calibration_seconds": round(calibration_seconds, 2),
        "total_seconds": round(time.perf_counter() - started, 2),
        "plans": records,
    }
    print(json.dumps(result, separators=(",", ":")))
    return 0


def add_cli(subparsers) -> None:
    """Register ``stepquant calibrate``."""
    parser = subparsers.add_parser(
        "calibrate",
        help="calibrate a model and write quantization plans (bits per unit, FP16 pivots, row impact)",
        description="Run a GDN / KDA model over calibration text, measure gate lifetimes, row impact and "
        "per-unit distortion (saved as DIR/stats.safetensors), and write one plan directory "
        "DIR/<variant>-<bits>/ per variant and budget. Prints a summary per plan, then one JSON line.",
    )
    parser.add_argument(
        "--model", default=None, help="a shipped model name (gdn, kda) or a transformers checkpoint directory"
    )
    parser.add_argument(
        "--bits", default="6", help="nominal budget(s) b̄ in bits/value, comma-separated (default 6)"
    )
    parser.add_argument(
        "--out", required=True, help="output directory (stats.safetensors and the plan directories); "
        "statistics or plans already in it are replaced only with --force"
    )
    parser.add_argument(
        "--force", action="store_true",
        help="replace the statistics and plan directories an earlier calibration wrote into --out"
    )
    parser.add_argument(
        "--variant",
        default="stepquant",
        help=f"'all' or a comma list of {', '.join(VARIANTS)} (default stepquant)",
    )
    parser.add_argument("--segments", type=int, default=32, help="calibration segments (default 32)")
    parser.add_argument("--segment-length", type=int, default=2048, help="tokens per segment (default 2048)")
    parser.add_argument(
        "--horizon",
        type=int,
        default=DEFAULT_HORIZON,
        help=f"lifetime horizon H in tokens for lambda_u (default {DEFAULT_HORIZON})",
    )
    parser.add_argument(
        "--pivots",
        type=int,
        default=None,
        help="FP16 pivot units for the variants with pivots (default: 1.39%% of GDN heads, "
        "0.625%% of KDA key rows, rounded)",
    )
    parser.add_argument(
        "--candidates",
        default=None,
        help="candidate bit widths, e.g. '4,5,6,7,8' (default b̄-2..b̄+2 within 2..8)",
    )
    parser.add_argument(
        "--exponent",
        type=float,
        default=None,
        help=f"w ~ omega^exponent (default {DEFAULT_EXPONENT}, the paper's 1/8)",
    )
    parser.add_argument(
        "--omega-floor",
        type=float,
        default=None,
        help=f"floor of omega relative to the head's largest (default {DEFAULT_OMEGA_FLOOR:g})",
    )
    parser.add_argument(
        "--snapshot-every",
        type=int,
        default=DEFAULT_SNAPSHOT_EVERY,
        help=f"tokens between state snapshots for the distortion (default {DEFAULT_SNAPSHOT_EVERY})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help=f"segments per forward pass (default {DEFAULT_BATCH_SIZE})",
    )
    parser.add_argument(
        "--data",
        default="calib",
        help="a shipped split name (default calib) or the path of your own .txt / .jsonl",
    )
    parser.add_argument("--device", default="cpu", help="device of the model when --device-map is not given")
    parser.add_argument(
        "--dtype",
        default="fp32",
        help="model weights: fp32 (default), bf16 or fp16; the recurrence is always replayed in FP32",
    )
    parser.add_argument("--device-map", default=None, help="accelerate device map, e.g. auto (several GPUs)")
    parser.add_argument(
        "--replay-device",
        default="cpu",
        help="where captured inputs go (FP32) and the replay runs (default cpu)",
    )
    parser.add_argument(
        "--stats", default=None, help=f"reuse statistics from DIR/{STATS_FILE} (no model run)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's own); 1 avoids OpenMP oversubscription on a machine "
        "shared with other jobs",
    )
    parser.add_argument(
        "--grid",
        choices=[g.value for g in Grid],
        default=DEFAULT_GRID.value,
        help="integer grid of the dual-axis quantizer (default "
        f"{DEFAULT_GRID.value}): the distortion table is measured with it and the plans record it in "
        "plan.json; with --stats the statistics must have been measured with the same grid. On KDA at "
        "4 bits midtread halved STEPQuant's excess NLL (docs/results/grid_probe_kda.md)",
    )
    parser.add_argument(
        "--row-stat",
        choices=list(ROW_STATS),
        default=DEFAULT_ROW_STAT,
        help=f"row statistic of the dual-axis quantizer (default {DEFAULT_ROW_STAT}); absmax and mean_abs "
        "were within noise of rms on the shipped models (docs/eval.md section 9)",
    )
    parser.add_argument(
        "--division",
        choices=list(DIVISIONS),
        default=DEFAULT_DIVISION,
        help=f"the quantizer's division (default {DEFAULT_DIVISION}): reciprocal is the CUDA decode "
        "kernel's fast contract (docs/kernels.md, 'Exact arithmetic'; on the shipped plans no worse in "
        "excess NLL: docs/results/quantizer_check.md)",
    )
    parser.add_argument(
        "--refit-iters",
        type=int,
        default=DEFAULT_REFIT_ITERS,
        help=f"weighted least-squares column refits (default {DEFAULT_REFIT_ITERS}); the CUDA kernel is "
        "fastest with 1 (or 0: measured no worse at 6 bits, 5.6 standard errors worse at 4 bits on GDN)",
    )
    parser.add_argument(
        "--row-fill",
        action="store_true",
        help="after the column scales, rescale each row so that its largest value reaches its grid's top "
        "(needs --division reciprocal; docs/eval.md section 11: the shipped plans use it)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.set_defaults(func=run_calibrate)

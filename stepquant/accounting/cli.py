"""`stepquant memory`: bytes per request, bits/value and the capacity model of every state format.

    stepquant memory --preset qwen3.8-27b --bits 6
    stepquant memory --config stepquant/assets/models/gdn --plan stepquant/assets/plans/gdn/stepquant-6
    stepquant memory --preset qwen3.8-27b --codec int8-ef4 --codec int6-ef4     # error feedback's bytes

Prints the tables of :func:`stepquant.accounting.report.format_report`, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stepquant.calibrate.plan import Plan
from stepquant.codecs import make_codec
from stepquant.families import shape_from_config

from .capacity import GIB
from .formulas import codec_bytes, plan_bytes
from .presets import PRESETS, get_preset
from .report import format_report, memory_report


def _run_memory(args: argparse.Namespace) -> int:
    if (args.preset is None) == (args.config is None):
        raise ValueError("give exactly one of --preset NAME or --config PATH/config.json")
    shape = get_preset(args.preset) if args.preset is not None else shape_from_config(args.config)
    plan = None
    if args.plan is not None:
        plan = Plan.load(args.plan, model_config=shape)  # refused with the model it was made for if it does
        # not fit; counted in the plan's own stored format: its LayerFormats
        plan = plan_bytes(plan.layer_formats(), shape,
                          label=f"plan {Path(args.plan).name} ({plan.variant}@{plan.budget_bits})")
    names = [name for item in args.codec or () for name in item.split(",") if name.strip()]
    extra = tuple(codec_bytes(make_codec(name), shape) for name in names)
    report = memory_report(shape, args.bits, args.pivots, args.batch, args.slots_per_request,
                           args.context, args.measured_bytes, plan,
                           None if args.budget_gib is None else int(args.budget_gib * GIB), extra)
    if not args.json:
        print(format_report(report))
    print(json.dumps(report, separators=(",", ":")))
    return 0


def add_cli(subparsers) -> None:
    """Register ``stepquant memory``."""
    parser = subparsers.add_parser(
        "memory",
        help="bytes/request, bits/value and serving capacity of every state format",
        description="Recurrent-state memory of FP32 / BF16 / INT-b / DSQ / STEPQuant for a model, and the "
                    "capacity model with (slots-per-request x B + 1) state slots. Prints tables, then one "
                    "JSON line.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), help="a model from the paper")
    source.add_argument("--config", metavar="PATH", help="a transformers config.json (or its folder)")
    parser.add_argument("--bits", type=int, default=6,
                        help="nominal budget b̄ in bits/value (2..8, default 6)")
    parser.add_argument("--pivots", type=int, default=None,
                        help="FP16 pivot units (GDN heads / KDA key rows); default: the paper's share "
                             "(32 heads = 1.39%% for Qwen3.8-27B, 512 rows = 0.625%% for Kimi-Linear)")
    parser.add_argument("--batch", type=int, default=64, help="concurrent requests B (default 64)")
    parser.add_argument("--slots-per-request", type=int, default=5,
                        help="state slots reserved per request (default 5: SGLang radix caching, "
                             "(5B+1) slots)")
    parser.add_argument("--context", type=int, default=0,
                        help="context tokens per request for the attention-KV term of the totals (default 0)")
    parser.add_argument("--measured-bytes", type=int, default=None,
                        help="a measured bytes/request to convert to bits/value and ratio (e.g. 21804032)")
    parser.add_argument("--plan", metavar="DIR", default=None,
                        help="a calibrated plan directory (stepquant calibrate --out, e.g. "
                             "plans/gdn/stepquant-6): adds its bytes per request, counted in the plan's "
                             "stored format; give the plan's model with --config")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="a GPU memory budget in GiB (e.g. 139.7 for an H200): adds the largest batch "
                             "that fits it with each state format (weights + slots + --context tokens of KV "
                             "per request)")
    parser.add_argument("--codec", action="append", default=None, metavar="NAME[,NAME]",
                        help="add registry formats to the bytes table (e.g. int8-ef4: INT8 with error "
                             "feedback and an INT4 residual; int6-sr, dsq4); repeatable")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.set_defaults(func=_run_memory)

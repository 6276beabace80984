"""`stepquant analyze`: argument parsing (light: the work is imported from run.py when it runs).

stepquant analyze --model gdn --out docs/results/analysis/gdn
stepquant analyze --model ./my-checkpoint --plan plans/stepquant-6 --analyses lifetime-error,bits --out DIR
"""

from __future__ import annotations

import argparse
import sys


def add_cli(subparsers) -> None:
    """Register ``stepquant analyze``."""
    from stepquant.eval.settings import SHIPPED_STREAMS

    from .run import ANALYSES, DEFAULT_PLAN_NAMES

    parser = subparsers.add_parser(
        "analyze",
        help="the paper's mechanism analyses on a model (lifetime vs error, feedback, row impact, state "
        "geometry, lifetime ranks, where the bits went)",
        description="Reproduce the paper's mechanism analyses on a GDN / KDA model: half-life vs accumulated "
        "INT6 error, native feedback vs the exact-read oracle, the row-impact identity and "
        "perplexity experiment, row/column outlier contrasts of the state, half-life ranks across "
        "texts, and the plans' bits. Writes PNG figures and analysis.json (our numbers beside the "
        "paper's) into --out; prints a summary, then one JSON line. docs/analysis.md explains each.",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="a shipped model name (gdn, kda) or a transformers checkpoint directory",
    )
    parser.add_argument(
        "--plan",
        action="append",
        default=None,
        metavar="DIR",
        help="a calibrated plan directory (repeatable); the first supplies the half-lives and "
        "omega, every plan gets a bits figure (default for a shipped model: its "
        f"{' and '.join(DEFAULT_PLAN_NAMES)} plans)",
    )
    parser.add_argument(
        "--plans-dir",
        default=None,
        help="where <model>/<variant>-<bits>/ plans live when --plan is not given "
        "(default: the shipped plans)",
    )
    parser.add_argument("--out", required=True, help="output directory (figures and analysis.json)")
    parser.add_argument(
        "--analyses", default="all", help=f"'all' (default) or a comma list of {', '.join(ANALYSES)}"
    )
    parser.add_argument(
        "--data",
        action="append",
        default=None,
        metavar="SOURCE[,SOURCE]",
        help="text the analyses run on: shipped held-out streams or .txt / .jsonl files "
        f"(default: {','.join(SHIPPED_STREAMS)})",
    )
    parser.add_argument(
        "--segments", type=int, default=1, help="streams per source for the trajectory analyses (default 1)"
    )
    parser.add_argument(
        "--segment-length", type=int, default=2048, help="tokens per stream (default 2048, the paper's)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="streams per forward pass of the capture run (default: all at once)",
    )
    parser.add_argument(
        "--inject-at",
        type=int,
        default=256,
        help="feedback: tokens before the one injected quantization error (default 256)",
    )
    parser.add_argument(
        "--identity-positions",
        type=int,
        default=8,
        help="row identity: probe positions per stream, spread from token 128 on (default 8)",
    )
    parser.add_argument(
        "--rank-segments",
        type=int,
        default=4,
        help="lifetime ranks: streams per source whose half-lives are measured (default 4)",
    )
    parser.add_argument(
        "--ppl-segments", type=int, default=1, help="row-impact perplexity: streams per source (default 1)"
    )
    parser.add_argument(
        "--ppl-tokens",
        type=int,
        default=1024,
        help="row-impact perplexity: tokens per stream (default 1024, the paper's)",
    )
    parser.add_argument(
        "--ppl-prefill",
        type=int,
        default=64,
        help="row-impact perplexity: tokens prefilled natively before the state is quantized (default 64)",
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=8,
        help="row-impact perplexity: omega-ranked row groups per head (default 8)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: fastest on a shared 2-core CPU)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.set_defaults(func=_run_from_cli)


def _run_from_cli(args: argparse.Namespace) -> int:
    from .run import run_analyze

    args.data = args.data or ["wiki,sotu,brown"]
    args.argv = sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "analyze" else getattr(args, "argv", [])
    return run_analyze(args)

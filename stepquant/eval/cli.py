"""`stepquant eval`: argument parsing (light: the work is imported from run.py when it runs).

    stepquant eval --quick --out docs/results                      # the committed table (docs/eval.md)
    stepquant eval --models gdn --methods int4,stepquant-4 --data my_text.jsonl
"""

from __future__ import annotations

import argparse
import sys

from stepquant.eval.methods import DEFAULT_METHODS, REFERENCE
from stepquant.eval.settings import DEFAULT_WINDOW, FULL, QUICK, SHIPPED_STREAMS


def add_cli(subparsers) -> None:
    """Register ``stepquant eval``."""
    parser = subparsers.add_parser(
        "eval",
        help="drift probe (excess NLL), perplexity and greedy generation of every state format",
        description="Evaluate state formats on GDN / KDA models: the Appendix E drift probe (excess NLL of "
                    "compressed-state decode vs the FP32 state), prefill perplexity and greedy generation "
                    "lengths, all methods batched. Writes eval.json, eval.md and PNG plots; prints the "
                    "table, then one JSON line.",
    )
    parser.add_argument("--models", "--model", action="append", default=None, metavar="NAME[,NAME]",
                        help="shipped model names (gdn, kda) or checkpoint directories (default: gdn,kda)")
    parser.add_argument("--methods", default=None,
                        help="comma list of methods: codec names (fp32, bf16, fp16, int8, int6, int4, "
                             "int4-sr, dsq4, ...) and calibrated plans <variant>-<bits> (stepquant, "
                             "temporal, temporal-nopivot, spatial), <method>@<layer> for one layer only; "
                             f"default: {','.join(DEFAULT_METHODS)}. "
                             f"{REFERENCE} (the reference) is always included")
    parser.add_argument("--plan", action="append", default=None, metavar="DIR",
                        help="add a calibrated plan directory as a method (repeatable)")
    parser.add_argument("--plans-dir", default=None,
                        help="where <model>/<variant>-<bits>/ plans live (default: the shipped plans, "
                             "stepquant/assets/plans/)")
    parser.add_argument("--data", action="append", default=None, metavar="STREAM[,STREAM]",
                        help="eval streams: shipped wiki, sotu, brown, or a .txt / .jsonl file "
                             "(default: wiki,sotu,brown)")
    parser.add_argument("--quick", action="store_true",
                        help=f"short settings for a 2-core CPU: P={QUICK['prefill']}, D={QUICK['decode']}, "
                             f"generation cap {QUICK['gen_max_new']} (default: P={FULL['prefill']}, "
                             f"D={FULL['decode']}, cap {FULL['gen_max_new']}, as in the paper)")
    parser.add_argument("--prefill", type=int, default=None, help="P, native prefill tokens per stream")
    parser.add_argument("--decode", type=int, default=None, help="D, forced decode updates per stream")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                        help=f"first/last window of decode predictions (default {DEFAULT_WINDOW})")
    parser.add_argument("--segments", type=int, default=None, help="segments (streams) per data source")
    parser.add_argument("--gen-prompts", dest="gen_prompts", type=int, default=None,
                        help="greedy-generation prompts per data source (0 skips generation)")
    parser.add_argument("--gen-prompt-tokens", dest="gen_prompt_tokens", type=int, default=None,
                        help="tokens per generation prompt")
    parser.add_argument("--gen-max-new", dest="gen_max_new", type=int, default=None,
                        help="generation cap in new tokens")
    parser.add_argument("--packed", action="store_true",
                        help="hold integer states bit-packed during the run (slower on CPU; same values)")
    parser.add_argument("--device", default="cpu",
                        help="device of the model when --device-map is not given (cuda: fla's chunk kernels "
                             "for the prefill; the recurrence of every method is still FP32)")
    parser.add_argument("--device-map", default=None, help="accelerate device map, e.g. auto (several GPUs)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process (default 1: fastest on a shared 2-core CPU)")
    parser.add_argument("--jobs", type=int, default=1, help="models evaluated in parallel processes")
    parser.add_argument("--out", default="eval_results", help="output directory (default eval_results/)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.set_defaults(func=_run_from_cli)


def _run_from_cli(args: argparse.Namespace) -> int:
    from stepquant.cli import check_device, check_output_dir
    from stepquant.eval.run import run_eval

    args.models = args.models or ["gdn,kda"]
    args.data = args.data or [",".join(SHIPPED_STREAMS)]
    args.argv = sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "eval" else getattr(args, "argv", [])
    if args.jobs < 1 or args.threads < 1:
        raise ValueError(f"--jobs and --threads must be >= 1, got {args.jobs} and {args.threads}")
    if args.device_map is None:
        check_device(args.device)
    check_output_dir(args.out)
    return run_eval(args)  # checks the other arguments and every model's methods before the first model

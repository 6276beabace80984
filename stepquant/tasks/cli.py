"""`stepquant tasks`: argument parsing (the work, which needs lm-eval, is imported from run.py when it runs).

    stepquant tasks --model gdn --methods fp32,int6,stepquant-6 --tasks stepquant_cloze,stepquant_continuation
    stepquant tasks --model /models/Qwen3.5-4B --device cuda --methods fp32,stepquant-6 --plans-dir runs \\
        --tasks gsm8k --batch-size 32          # a hub task, where the hub is reachable (docs/tasks.md)
"""

from __future__ import annotations

import argparse
import sys

from stepquant.eval.methods import DEFAULT_METHODS, REFERENCE

OFFLINE_TASKS = "stepquant_cloze,stepquant_continuation"


def add_cli(subparsers) -> None:
    """Register ``stepquant tasks``."""
    parser = subparsers.add_parser(
        "tasks",
        help="lm-eval tasks with the recurrent state in several formats: accuracy and its difference to FP32",
        description="Run lm-evaluation-harness tasks once per state format through the `stepquant` lm-eval "
                    "model (prefill native, every decode step reads and writes the compressed state) and "
                    "write one table: tasks.json, tasks.md and a bar plot per model.",
    )
    parser.add_argument("--models", "--model", action="append", default=None, metavar="NAME[,NAME]",
                        help="shipped model names (gdn, kda) or checkpoint directories (default: gdn)")
    parser.add_argument("--methods", default=None,
                        help="comma list of methods as in stepquant eval (fp32, bf16, int8, int6, int4-sr, "
                             f"dsq4, stepquant-6, ...); default: {','.join(DEFAULT_METHODS)} (plans that do "
                             f"not exist skipped). {REFERENCE} is always run, first")
    parser.add_argument("--plan", action="append", default=None, metavar="DIR",
                        help="add a calibrated plan directory as a method (repeatable)")
    parser.add_argument("--plans-dir", default=None, help="where <model>/<variant>-<bits>/ plans live "
                        "(default: the shipped plans)")
    parser.add_argument("--tasks", default=OFFLINE_TASKS,
                        help=f"comma list of lm-eval task names (default: the offline tasks {OFFLINE_TASKS}; "
                             "hub tasks such as gsm8k need the hub)")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--num-fewshot", type=int, default=None,
                        help="few-shot examples (default: the task's)")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward (default 8)")
    parser.add_argument("--decode-context", type=int, default=0,
                        help="the last K context tokens of every request run as compressed-state decode "
                             "steps (default 0: the context is prefilled natively)")
    parser.add_argument("--device", default="cpu",
                        help="device of the model (cuda: plans use the packed pool)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: fastest on a shared 2-core CPU)")
    parser.add_argument("--out", default="task_results", help="output directory (default task_results/)")
    parser.add_argument("--no-plots", action="store_true", help="skip the bar plots")
    parser.set_defaults(func=_run_from_cli)


def _run_from_cli(args: argparse.Namespace) -> int:
    from stepquant.cli import check_device, check_output_dir

    args.models = args.models or ["gdn"]
    args.argv = sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "tasks" else getattr(args, "argv", [])
    for flag, value, low in (("--batch-size", args.batch_size, 1), ("--threads", args.threads, 1),
                             ("--decode-context", args.decode_context, 0), ("--limit", args.limit, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    check_device(args.device)
    check_output_dir(args.out)
    try:
        from stepquant.tasks.run import run_tasks
    except ImportError as err:
        raise ValueError(f"stepquant tasks needs lm-eval: pip install 'stepquant[tasks]' ({err})") from None
    return run_tasks(args)

"""The `stepquant` command line: calibrate | eval | memory | analyze | tasks.

Each sub-command lives next to the code it drives and registers itself through an
``add_cli(subparsers)`` function; this file only lists those modules, so adding a command is
one line here. It also holds the checks the commands share before their expensive part
(:func:`check_output_dir`, :func:`check_device`), and :func:`main` turns the errors a user can fix
(bad arguments, files, devices, memory) into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

COMMAND_MODULES = (
    "stepquant.accounting.cli",  # memory
    "stepquant.eval.cli",  # eval
    "stepquant.calibrate.cli",  # calibrate
    "stepquant.analysis.cli",  # analyze
    "stepquant.tasks.cli",  # tasks (lm-eval)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepquant",
        description="Compress the recurrent state of GDN / KDA linear-attention LLMs to 4-6 bits.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_cli(sub)
    return parser


def check_output_dir(path: str | Path, flag: str = "--out") -> Path:
    """Create ``path`` (with its parents) and write and delete a file in it: a directory the command
    cannot write is reported before the work, not after it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path} is not a directory this user can write ({err.strerror or err}); "
                         "choose another") from None
    return path


def check_device(device: str, flag: str = "--device") -> None:
    """ValueError unless ``device`` is a torch device this machine has (e.g. "cuda" without a GPU)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{flag} {device!r} is not a torch device ({err}); use e.g. cpu or cuda") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise ValueError(f"{flag} {device}: no CUDA GPU is available here (torch {torch.__version__}, "
                             f"{build}); use {flag} cpu")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"{flag} {device}: this machine has {count} CUDA GPU(s), cuda:0 .. "
                             f"cuda:{count - 1}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, OSError, RuntimeError) as err:  # OSError: files; RuntimeError: torch
        print(f"stepquant {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The `stepquant` command line: calibrate | eval | memory | analyze.

Each sub-command lives next to the code it drives and registers itself through an
``add_cli(subparsers)`` function; this file only lists those modules, so adding a command is
one line here.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "stepquant.accounting.cli",  # memory
    "stepquant.eval.cli",  # eval
    "stepquant.calibrate.cli",  # calibrate
    "stepquant.analysis.cli",  # analyze
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"stepquant {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The ``megalith`` command line.

Each stage registers its own subcommands (``preprocessing.cli``, ...); this module
only assembles them, so ``megalith --help`` lists everything and a stage's heavy
imports happen only when its command runs.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Sequence

from megalith import __version__
from megalith.errors import MegalithError, storage_error_message

# Modules whose register(subparsers) adds a stage's subcommands.
COMMAND_MODULES = [
    "preprocessing.cli",
    "training.cli",
    "training.interop.cli",
    "training.checkpoint.cli",
    "training.memory.cli",
    "training.planning.cli",
    "training.finetune.cli",
    "evaluation.cli",
    "registry.cli",
    "deploy.cli",
    "pipelines.commands",
]


class SuggestingParser(argparse.ArgumentParser):
    """An argument parser whose "invalid choice" errors name the nearest valid choice
    (``megalith trian`` → did you mean 'train'?). Subcommand parsers inherit the class."""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        choices = action.choices
        if choices is not None and value not in choices and isinstance(value, str):
            names = [str(choice) for choice in choices]
            nearest = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
            if nearest:
                raise argparse.ArgumentError(
                    action, f"invalid choice: {value!r}; did you mean {nearest[0]!r}?"
                )
        super()._check_value(action, value)


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="megalith",
        description="Train Megatron-style language models as orchestrated, observable pipelines.",
    )
    parser.add_argument("--version", action="version", version=f"megalith {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        # A group such as `megalith data` without its subcommand: show its help.
        (getattr(args, "group_parser", None) or parser).print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (MegalithError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a full disk, a quota, a size limit: one line naming the file
        message = storage_error_message(exc)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

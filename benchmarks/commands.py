"""The command line of a benchmark script that measures one thing several ways: ``python benchmarks/<script>.py
COMMAND [flags]``, each command with its own flags and ``--help`` (its description: what it measures and how)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
"""What a command measures (its first line is the short help), what adds its flags, what runs it."""


def run(about: str, commands: dict[str, Command], argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's) as one of ``commands`` and run it; its exit status."""
    parser = argparse.ArgumentParser(description=about, formatter_class=argparse.RawDescriptionHelpFormatter)
    chosen = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (description, arguments, _) in commands.items():
        arguments(chosen.add_parser(name, help=description.split("\n")[0], description=description,
                                    formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    return commands[args.command][2](args)

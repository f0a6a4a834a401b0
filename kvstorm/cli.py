"""The ``kvstorm`` command: one entry point, one subcommand per job.

Each package registers its own subcommands, so this module is the only place
that knows about all of them.
"""

from __future__ import annotations

import argparse
import sys

from engine.cli import add_generate_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstorm", description="continuous-batching LLM engine and chaos harness")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"kvstorm {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

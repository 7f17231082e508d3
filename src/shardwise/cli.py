"""The `shardwise` command."""

from __future__ import annotations

import argparse
import sys

import shardwise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="Sharded data-parallel training (ZeRO 1/2/3) that keeps parameter sharing exact.",
    )
    parser.add_argument("--version", action="version", version=f"shardwise {shardwise.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "demo", add_help=False,
        help="train the small GPT on the Python standard library's source on 2 ranks "
             "(`shardwise demo --help` for its options)",
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from shardwise import demo

        return demo.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The `shardwise` command: `demo`, `estimate`, `plan`, `units` and `ckpt` (their code is beside this file)."""

from __future__ import annotations

import argparse
import os
import sys

import shardwise.cli.ckpt as cli_ckpt
import shardwise.cli.estimate as cli_estimate
import shardwise.cli.max_model as cli_max_model
from shardwise._version import __version__

# What a shell reports for a command that SIGPIPE ended (128 + 13): `shardwise ckpt inspect DIR | head`.
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """Run the command; its exit status. A reader that stops reading (`| head`) ends it quietly, as it ends
    any Unix tool, instead of with a BrokenPipeError traceback (Python ignores SIGPIPE, so a write to a
    closed pipe raises)."""
    try:
        status = _dispatch(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # inside the try: what is still buffered may meet the closed pipe too
        return status
    except BrokenPipeError:
        # Python's own advice (the signal module's "Note on SIGPIPE"): point stdout at /dev/null, so the
        # interpreter's last flush at exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _dispatch(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="Sharded data-parallel training (ZeRO 1/2/3) that keeps parameter sharing exact.",
    )
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "demo", add_help=False,
        help="train the small GPT on the Python standard library's source on 2 ranks "
             "(`shardwise demo --help` for its options)",
    )
    cli_ckpt.add_commands(commands)
    cli_estimate.add_commands(commands)
    cli_estimate.add_units_command(commands)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from shardwise import demo

        return demo.main(rest)
    if args.command == "plan" and not rest and (args.max_model is not None or args.step != 1 or args.limit):
        return cli_max_model.run(args)
    if args.command in ("estimate", "plan") and not rest:
        return cli_estimate.run(args)
    if args.command == "units" and not rest:
        return cli_estimate.run_units(args)
    if args.command == "ckpt" and not rest:
        return cli_ckpt.run(args)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    parser.print_help()
    return 0


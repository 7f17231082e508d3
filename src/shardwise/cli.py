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
    _add_ckpt_commands(commands)
    from shardwise import cli_estimate

    cli_estimate.add_commands(commands)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from shardwise import demo

        return demo.main(rest)
    if args.command in ("estimate", "plan") and not rest:
        return cli_estimate.run(args)
    if args.command == "ckpt" and not rest:
        return _run_ckpt(args, parser)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    parser.print_help()
    return 0


def _add_ckpt_commands(commands) -> None:
    ckpt = commands.add_parser(
        "ckpt", help="inspect, export or compare checkpoints (`shardwise ckpt --help`)",
        description="Work with checkpoints that sw.save wrote; no model and no process group needed.",
    )
    actions = ckpt.add_subparsers(dest="action", metavar="ACTION")
    inspect = actions.add_parser(
        "inspect", help="strategy, world size, step, keys, shapes, sizes; verifies every file's checksum",
        description="Describe checkpoint DIR and verify every file against the digest in its index "
                    "(reads every byte). Exit status 1 when a file is missing, truncated or corrupt.",
    )
    inspect.add_argument("dir", metavar="DIR", help="a checkpoint directory (the one holding index.json)")
    inspect.add_argument("--no-verify", action="store_true", help="skip reading the files (fast)")
    export = actions.add_parser(
        "export", help="write the parameters and buffers to one plain model.safetensors",
        description="Write checkpoint DIR's full parameters and buffers to OUT, a safetensors file that "
                    "`safetensors.torch.load_model(model, OUT)` loads without shardwise (tied weights "
                    "stored once). One tensor is in memory at a time.",
    )
    export.add_argument("dir", metavar="DIR", help="a checkpoint directory")
    export.add_argument("out", metavar="OUT.safetensors", help="the file to write")
    diff = actions.add_parser(
        "diff", help="keys, shapes and dtypes that differ between two checkpoints",
        description="Compare DIR and OTHER (checkpoint directories, .safetensors files or torch.save'd "
                    "state dicts): keys only in one, shapes or dtypes that differ. Exit status 1 when "
                    "they differ.",
    )
    diff.add_argument("dir", metavar="DIR")
    diff.add_argument("other", metavar="OTHER")
    diff.add_argument("--values", action="store_true",
                      help="also compare values (reads both whole, one tensor at a time)")
    ckpt.set_defaults(ckpt_parser=ckpt)


def _run_ckpt(args, parser) -> int:
    from shardwise import _ckpt_tools
    from shardwise.errors import ShardwiseError

    try:
        if args.action == "inspect":
            lines, ok = _ckpt_tools.inspect(args.dir, verify=not args.no_verify)
            print("\n".join(lines))
            return 0 if ok else 1
        if args.action == "export":
            print(f"wrote {_ckpt_tools.export_checkpoint(args.dir, args.out)}")
            return 0
        if args.action == "diff":
            lines, same = _ckpt_tools.diff(args.dir, args.other, values=args.values)
            print("\n".join(lines))
            return 0 if same else 1
    except ShardwiseError as error:
        print(f"shardwise ckpt {args.action}: {error}", file=sys.stderr)
        return 2
    args.ckpt_parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

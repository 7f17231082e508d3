"""`shardwise ckpt inspect|export|diff`: checkpoints without a model or a process group."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from shardwise.checkpoint.interop import tools
from shardwise.errors import ShardwiseError


def add_commands(commands) -> None:
    """`shardwise ckpt inspect|export|diff`."""
    ckpt = commands.add_parser(
        "ckpt", help="inspect, export or compare checkpoints (`shardwise ckpt --help`)",
        description="Work with checkpoints that sw.save wrote; no model and no process group needed.",
    )
    actions = ckpt.add_subparsers(dest="action", metavar="ACTION")
    inspect = actions.add_parser(
        "inspect", help="strategy, world size, step, keys, shapes, sizes; verifies every file's checksum",
        description="Describe checkpoint DIR and verify every file against the digest in its index "
                    "(reads every byte). Exit status 1 when a file is missing, truncated or corrupt, or DIR "
                    "holds files its index does not list; 2 when index.json itself is damaged.",
    )
    inspect.add_argument("dir", metavar="DIR", help="a checkpoint directory (the one holding index.json)")
    inspect.add_argument("--no-verify", action="store_true", help="skip reading the files (fast)")
    export = actions.add_parser(
        "export", help="write the parameters and buffers to one plain model.safetensors",
        description="Write checkpoint DIR's full parameters and buffers to OUT, a safetensors file that "
                    "`safetensors.torch.load_model(model, OUT)` loads without shardwise (tied weights "
                    "stored once). One tensor is in memory at a time. When DIR was saved from a Hugging "
                    "Face model (its config is recorded at save), config.json is written beside OUT too, so "
                    "`from_pretrained(OUT's directory)` loads it (name OUT model.safetensors); otherwise the "
                    "command says that the checkpoint does not know its model's config. The config's layer count "
                    "and hidden size are checked against the tensors first, code references (auto_map, "
                    "custom_pipelines) are left out, and a different config.json already there is not replaced "
                    "unless --replace-config.",
    )
    export.add_argument("dir", metavar="DIR", help="a checkpoint directory")
    export.add_argument("out", metavar="OUT.safetensors", help="the file to write")
    export.add_argument("--mkdir", action="store_true", help="create OUT's directory when it does not exist")
    export.add_argument("--replace-config", action="store_true",
                        help="replace a config.json beside OUT that describes another model")
    diff = actions.add_parser(
        "diff", help="keys, shapes and dtypes that differ between two checkpoints",
        description="Compare DIR and OTHER (checkpoint directories, .safetensors files or torch.save'd "
                    "state dicts): keys only in one, shapes or dtypes that differ. Exit status 1 when "
                    "they differ.",
    )
    diff.add_argument("dir", metavar="DIR")
    diff.add_argument("other", metavar="OTHER")
    diff.add_argument("--values", action="store_true",
                      help="also compare values (reads both 16 MiB at a time: whole rows, or a larger row in parts)")
    ckpt.set_defaults(ckpt_parser=ckpt)


# Note [terminal-safe output]: names, ids and values in a checkpoint are anyone's text; printed raw,
# an escape sequence in a name writes the clipboard (OSC 52), moves the cursor up and erases the
# lines that said "CORRUPT", or changes the terminal's title. Every line this command prints has
# its control characters (C0, DEL, C1, and Unicode's line and bidirectional controls) escaped.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every control character escaped as \\xNN or \\uNNNN (Note [terminal-safe output])."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else f"\\u{ord(m.group()):04x}",
                        text)


def _say(lines, file=None) -> None:
    print("\n".join(printable(line) for line in lines), file=file)


def run(args) -> int:
    """Run the parsed `shardwise ckpt ...` command; its exit status."""
    try:
        return _run(args)
    except ShardwiseError as error:
        _say([f"shardwise ckpt {args.action}: {error}"], file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as error:  # a tensor too large to hold (torch's allocator raises either)
        _say([f"shardwise ckpt {args.action}: cannot hold a tensor of it in memory ({str(error)[:200]})"],
             file=sys.stderr)
        return 2


def _run(args) -> int:
    for path in filter(None, (getattr(args, "dir", None), getattr(args, "other", None))):
        if not Path(path).exists():
            raise ShardwiseError(f"{path} does not exist")
    if args.action == "inspect":
        lines, ok = tools.inspect(args.dir, verify=not args.no_verify)
        _say(lines)
        return 0 if ok else 1
    if args.action == "export":
        folder = Path(args.out).parent
        created = not folder.is_dir()
        if created and not args.mkdir:
            raise ShardwiseError(f"directory {folder} does not exist: create it, or pass --mkdir")
        exported = tools.export_checkpoint(args.dir, args.out, replace_config=args.replace_config)
        _say([f"created {folder}/"] * created + [f"wrote {exported.path}", *_config_lines(exported)])
        return 0
    if args.action == "diff":
        lines, same = tools.diff(args.dir, args.other, values=args.values)
        _say(lines)
        return 0 if same else 1
    args.ckpt_parser.print_help()
    return 0


def _config_lines(exported: tools.Exported) -> list[str]:
    """What the export did about config.json (Note [model config] in checkpoint/format/model_config.py)."""
    written = exported.path
    if exported.config is None:
        return [("no config.json: this checkpoint does not record a Hugging Face config (it was saved from a model "
                 "without one, from a model that holds one under names of its own such as a PeftModel or a wrapper, "
                 "or by an earlier shardwise). For from_pretrained, save or export the Hugging Face model itself, or "
                 f"write its config beside it: model.config.save_pretrained({str(written.parent)!r})")]
    lines = [f"wrote {exported.config} (the config recorded at save, checked against the tensors)"]
    if exported.dropped:
        lines.append(f"left out of it: {', '.join(exported.dropped)} (references to code that from_pretrained "
                     "would import with trust_remote_code=True; add them back only from a source you trust)")
    if written.name != "model.safetensors":
        lines[0] += f"; from_pretrained({str(written.parent)!r}) reads model.safetensors: name OUT so to load it there"
    return lines

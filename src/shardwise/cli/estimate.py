"""`shardwise estimate` and `shardwise plan`: the estimator from the shell.

    shardwise estimate gpt d_model=512 n_layers=8 vocab_size=8192 --strategy zero3 \\
        --world-size 4 --precision bf16 --batch 4 --seq 128
    shardwise plan llama hidden_size=2048 num_hidden_layers=22 --memory 8GiB --world-size 4
    shardwise estimate gpt n_layers=8 --strategy zero3 --world-size 4 --pipe 2    # pipe 2 x zero3 2
    shardwise plan gpt d_model=512 --memory 2GiB --world-size 4 --max-model   # the deepest each row trains

MODEL [KEY=VALUE ...] is read by cli/models.py: a zoo name, module:function, a .py file, a
Hugging Face model type with its sizes, or a directory with a config.json.
Every model is built under `torch.device("meta")`: only shapes are read, nothing is allocated;
`--batch` runs the activation probe (estimate/probe.py) on meta tensors too. The RSS that
importing and building a module:function model adds to this process (e.g. transformers)
is added to the runtime row: a training script imports the same (the meta device's own
machinery is loaded before that is measured: a rank building its model for real never loads it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import sys

import torch
from torch import nn

from shardwise.cli.models import HELP as MODEL_HELP
from shardwise.cli.models import build_model, load_function
from shardwise.engine.describe import describe
from shardwise.errors import ShardwiseError
from shardwise.estimate.core import MIB, OPTIMIZERS, RUNTIME_BYTES, RUNTIME_BYTES_SINGLE, estimate
from shardwise.estimate.measure import process_rss
from shardwise.estimate.pipe import estimate_pipe, plan_pipe
from shardwise.estimate.plan import PLAN_MARGIN, plan, usable_memory

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """"8GiB" -> 8·2**30, "512MiB", "1.5GB" (decimal), "1000000" (bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ShardwiseError(f"memory size {text!r} is not understood: write e.g. 8GiB, 512MiB or 2GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_margin(text: str) -> float:
    """"3%" -> 0.03: the share of the budget a plan keeps free (Note [plan margin])."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*%\s*", text)
    if not match or float(match.group(1)) >= 100:
        raise ShardwiseError(f"--margin {text!r} is not a percentage below 100: write e.g. --margin 3% (the "
                             "default) or --margin 0% (plan to the byte)")
    return float(match.group(1)) / 100


# ---- the two commands --------------------------------------------------------------


def add_commands(commands) -> None:
    """Add `estimate` and `plan` to the `shardwise` command's subparsers."""
    est = commands.add_parser(
        "estimate", help="per-rank memory of one configuration, by kind, before building anything",
        description="Predict what one rank holds (parameters, gradients, optimizer state, gather/reduce "
                    "buffers, activations, Python + torch) for a strategy, world size and precision.")
    _add_model(est)
    est.add_argument("--model", dest="model_option", default=None, help=argparse.SUPPRESS)  # the older spelling
    est.add_argument("--strategy", default="zero3", choices=("ddp", "zero1", "zero2", "zero3"),
                     help="default: zero3")
    est.add_argument("--world-size", type=int, default=1, help="ranks (default: 1)")
    est.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"), help="default: fp32")
    est.add_argument("--offload", default=None, metavar="host|disk:PATH",
                     help="host: master rows, their gradients and optimizer state in host memory, counted apart from "
                          "the device's (zero1/2/3); disk:PATH: master shards and optimizer state in memory-mapped "
                          "files under PATH (zero3)")
    est.add_argument("--pipe", type=int, default=None, metavar="STAGES",
                     help="a pipeline of STAGES stages (shardwise.pipeline, strategy zero1/2/3), each stage's layers "
                          "sharded over --shards of its ranks: the per-rank table of each stage (estimate/pipe.py)")
    est.add_argument("--shards", type=int, default=None,
                     help="with --pipe: ranks each stage is sharded over (default: all of the stage's)")
    est.add_argument("--regather", action="store_true",
                     help="with --pipe and zero3: each micro-batch gathers the units again, "
                          "PipelineConfig(keep_gathered=False) (default: the whole stage stays gathered in a step)")
    _add_common(est)
    pl = commands.add_parser(
        "plan", help="the cheapest configuration that fits a per-rank memory budget, and why others do not",
        description="Weigh ddp, zero1, zero2, zero3, zero3+bf16 and zero3 with disk offload (cheapest "
                    "first) against --memory per rank; name the first that fits and say why each other "
                    "does not. When none fits and MODEL is a chain of layers (shardwise.pipeline), the pipe x "
                    "shard layouts are weighed too (activations not counted for them). A row fits when its "
                    "estimate is within the budget less --margin (3%, for the estimator's error). With --max-model: "
                    "for a model family (gpt or a Hugging Face model type or config), the largest depth (or KEY) "
                    "each configuration trains. Exit status 1 when none fits.")
    _add_model(pl)
    pl.add_argument("--memory", required=True, help="per-rank budget, e.g. 8GiB, 512MiB, 2GB")
    pl.add_argument("--world-size", type=int, required=True, help="ranks")
    pl.add_argument("--offload-dir", default="/tmp/shardwise-offload",
                    help="directory the offload options would use (default: /tmp/shardwise-offload)")
    pl.add_argument("--margin", default=f"{PLAN_MARGIN:.0%}",
                    help="share of --memory kept free for the estimator's error: 3%% by default (Note [plan margin]: "
                         "its measured error was -1.3%% to +5.9%%), 0%% to plan to the byte")
    pl.add_argument("--max-model", nargs="?", const="depth", default=None, metavar="KEY",
                    help="instead of one model's plan: the largest model of MODEL's family each configuration "
                         "trains within --memory, by sw.estimate (sw.max_model). MODEL is gpt or a Hugging Face "
                         "model type or config.json with its other sizes as KEY=VALUE; KEY is the size left free "
                         "(default: the depth, n_layers or num_hidden_layers; e.g. hidden_size with --step 64)")
    pl.add_argument("--step", type=int, default=1, help="with --max-model: sizes searched from --step by --step "
                                                         "(default: 1)")
    pl.add_argument("--limit", type=int, default=None,
                    help="with --max-model: the largest size tried (default: 1024 steps); a row that fits there is "
                         "shown as >= it")
    pl.add_argument("--pipelines", action="store_true",
                    help="also weigh the pipe x shard layouts (shardwise.pipeline: STAGES stages, each sharded over "
                         "its ranks) and print their rows; without it they are weighed only when nothing flat fits")
    _add_common(pl)


def _add_model(parser) -> None:
    parser.add_argument("model", metavar="MODEL", nargs="?", help=MODEL_HELP)
    parser.add_argument("overrides", metavar="KEY=VALUE", nargs="*",
                        help="sizes for gpt or a Hugging Face model type, e.g. hidden_size=512 num_hidden_layers=4")


def model_spec(args) -> str:
    """MODEL as given (estimate also takes the older --model MODEL); a one-line error when missing."""
    spec = args.model or getattr(args, "model_option", None)
    if not spec:
        raise ShardwiseError(f"name a MODEL: shardwise {args.command} MODEL [KEY=VALUE ...] (e.g. `shardwise "
                             f"{args.command} llama hidden_size=512 num_hidden_layers=4`)")
    return spec


def _add_common(parser) -> None:
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                        help="default: adamw (8 bytes of state per parameter); adamw8bit, adamw4bit: torchao's "
                             "low-bit AdamW (quantized moments for tensors of >= 4096 elements its block divides, "
                             "each parameter's state on one owner rank, torchao's runtime and the whole-tensor "
                             "step's buffers counted; no offload rows)")
    parser.add_argument("--units", default="auto", metavar="UNITS",
                        help="how shard() cuts the model: 'auto' (default: its declared or repeated blocks), a "
                             "block class name, or comma-separated module names")
    parser.add_argument("--batch", type=int, default=None,
                        help="samples per rank per step, for activations: measured by one forward + backward "
                             "on meta tensors (no memory, any model size)")
    parser.add_argument("--seq", type=int, default=None,
                        help="tokens per sequence (default: the model's maximum length)")
    parser.add_argument("--inputs", default=None, metavar="module:function",
                        help="for --batch: a function (batch, seq, device) -> the model's inputs (a dict of "
                             "keyword arguments, a tuple or a tensor; with a loss among the outputs, or its "
                             "first tensor's mean is used). Hugging Face models with input_ids or pixel_values "
                             "need none. A forward that reads values cannot run on meta: then the probe runs "
                             "on CPU at batches 1 and 2, and the model must fit one process")
    parser.add_argument("--json", action="store_true", help="print the estimate(s) as JSON")
    parser.add_argument("--checkpoint-activations", action="store_true",
                        help="recompute each unit's forward in backward (zero strategies), as "
                             "sw.shard(..., checkpoint_activations=True) does: the probe runs the checkpointed "
                             "step (each block's input kept, one block's activations live during its recompute)")
    parser.add_argument("--optimizer-in-backward", action="store_true",
                        help="step each unit in backward and free its gradient, as sw.optimizer_in_backward does "
                             "(zero strategies): one unit's gradients at a time (estimate, plan --max-model)")


def prepare(args) -> tuple[str, nn.Module, dict, int]:
    """MODEL built on meta, and the keyword arguments every estimate of it takes (units=, runtime=, inputs=):
    its spec, the model, those arguments and the RSS its import and build added (counted in runtime=)."""
    spec = model_spec(args)
    _warm_meta()
    gc.collect()  # garbage freed while the model builds would hide what its import holds
    before = process_rss()
    model, units = build_model(spec, args.overrides)
    imported = max(0, process_rss() - before) if _is_function(spec) else 0
    args.model = " ".join([spec, *args.overrides])  # as the output names it
    units = _units(model, args.units, units)
    runtime = (RUNTIME_BYTES if args.world_size > 1 else RUNTIME_BYTES_SINGLE) + imported
    inputs = load_function(args.inputs) if args.inputs else None
    return spec, model, dict(units=units, runtime=runtime, inputs=inputs), imported


def run(args) -> int:
    """Run `shardwise estimate` or `shardwise plan` from parsed arguments."""
    try:
        _, model, extra, imported = prepare(args)
        if args.command == "estimate" and args.pipe is not None:
            return _print_pipe(model, args, extra["runtime"])
        if args.command == "estimate":
            est = estimate(model, args.strategy, args.world_size, args.precision, args.optimizer,
                           args.offload, args.batch, args.seq, checkpoint_activations=args.checkpoint_activations,
                           optimizer_in_backward=args.optimizer_in_backward, **extra)
            if imported and not args.json:
                est = dataclasses.replace(est, notes=est.notes + (
                    f"runtime includes {imported / MIB:.0f} MiB that importing and building {args.model} added",))
            print(json.dumps(as_json(est)) if args.json else est)
            return 0
        return _print_plan(model, extra, args)
    except ShardwiseError as error:
        print(f"shardwise {args.command}: {error}", file=sys.stderr)
        return 2


def _warm_meta() -> None:
    """Load what building any model on the meta device loads first (about 32 MiB of torch's own
    modules, torch 2.13), so that the RSS a MODEL adds counts only its own code and imports
    (transformers): a training rank that builds its model for real never loads them."""
    with torch.device("meta"):
        nn.Sequential(nn.Embedding(3, 2), nn.LayerNorm(2), nn.Linear(2, 2))


def _is_function(spec: str) -> bool:
    """MODEL is code from outside shardwise (module:function, a file, Hugging Face): its imports count."""
    from shardwise.models.zoo import ZOO

    return spec not in ZOO and spec != "gpt" and not spec.startswith("gpt:")


def as_json(est) -> dict:
    """An estimate as --json prints it: its fields, total and model_state (None: a row not estimated)."""
    if est is None:
        return None
    return dict(dataclasses.asdict(est), total=est.total, model_state=est.model_state)


def _units(model: nn.Module, text: str, model_default):
    """--units: 'auto' (the model spec's own block class when it has one), a class name, or names."""
    if text == "auto":
        return model_default if model_default is not None else "auto"
    classes = {type(m).__name__: type(m) for m in model.modules()}
    if "," not in text and text in classes:
        return classes[text]
    return [name.strip() for name in text.split(",") if name.strip()]


def _units_argument(units) -> str:
    if units == "auto" or units is None:
        return ', units="auto"'
    if isinstance(units, type):
        return f", units={units.__name__}"
    return f", units={list(units)!r}"


ALLOCATOR = "MALLOC_MMAP_THRESHOLD_=65536"  # the environment the estimate is calibrated in (Note [allocator])


def _print_plan(model, extra: dict, args) -> int:
    if args.optimizer_in_backward:
        raise ShardwiseError("--optimizer-in-backward goes with `shardwise estimate` or `shardwise plan --max-model`: "
                             "the plan's rows include ddp, which has no optimizer in backward")
    memory, units, margin = parse_bytes(args.memory), extra["units"], parse_margin(args.margin)
    usable = usable_memory(memory, margin)  # the pipe rows keep the flat rows' margin: Note [plan margin]
    options = plan(model, memory, args.world_size, optimizer=args.optimizer, batch=args.batch, seq=args.seq,
                   offload_dir=args.offload_dir, checkpoint_activations=args.checkpoint_activations, margin=margin,
                   **extra)
    if args.json:
        print(json.dumps([dict(label=o.label, fits=o.fits, reason=o.reason, estimate=as_json(o.estimate))
                          for o in options]))
        return 0 if any(o.fits for o in options) else 1
    num_params = sum(p.numel() for p in model.parameters())
    batch = f", batch {args.batch}" if args.batch else ", no activations (pass --batch)"
    print(f"{args.model}: {num_params / 1e6:.1f}M parameters, {args.world_size} ranks, "
          f"{memory / 2**30:.2f} GiB per rank ({margin:.0%} kept for the estimator's error), {args.optimizer}{batch}")
    best = next((o for o in options if o.fits), None)
    width = max(len(o.label) for o in options) + 2
    for option in options:
        total = f"{option.estimate.total / MIB:>10,.0f} MiB" if option.estimate else f"{'—':>14}"
        verdict = "fits  <- cheapest that fits" if option is best else ("fits" if option.fits else option.reason)
        print(f"  {option.label:<{width}}{total}   {verdict}")
    if best is None:
        rescue = _fits_with_recompute(model, memory, margin, extra, args)
        if rescue is None and _print_pipe_rows(model, usable, args, extra["runtime"], propose=True):
            return 0
        if rescue is not None:
            print(f"nothing fits as asked; with checkpoint_activations {rescue.label} fits "
                  f"({rescue.estimate.total / MIB:,.0f} MiB): run `shardwise plan` again with "
                  "--checkpoint-activations for the whole table")
        else:
            print("nothing fits: add ranks, " + ("lower the batch, " if args.batch else "")  # no batch: none to lower
                  + ("" if args.checkpoint_activations or not args.batch else "checkpoint activations, ")
                  + "or raise the budget")
        return 1
    if args.pipelines:
        _print_pipe_rows(model, usable, args, extra["runtime"], propose=False)
    offload = f', offload="{best.offload}"' if best.offload else ""
    recompute = ", checkpoint_activations=True" if args.checkpoint_activations and best.strategy != "ddp" else ""
    print(f'use: sw.shard(model, strategy="{best.strategy}", precision="{best.precision}"{_units_argument(units)}'
          f'{offload}{recompute})')
    print(f"     units: {_units_summary(model, units)}; `shardwise units {args.model}` prints the table")
    print("run: torchrun ... with sw.init() in the script (on CPU it fixes glibc's mmap threshold at 64 KiB, "
          f"the allocator the estimate is peak RSS in: Note [allocator at init]; a script without sw.init: {ALLOCATOR} "
          "torchrun ..., else glibc's default keeps freed blocks resident and can exceed the plan by 16-30%)")
    return 0


def _print_pipe(model, args, runtime: int) -> int:
    """`shardwise estimate --pipe STAGES`: each stage's per-rank table (Note [pipe estimate])."""
    est = estimate_pipe(model, args.strategy, args.world_size, args.pipe, shards=args.shards,
                        precision=args.precision, optimizer=args.optimizer, runtime=runtime,
                        keep_gathered=not args.regather)
    if args.json:
        print(json.dumps(dict(label=est.label, total=est.total, bounds=est.bounds, build_bytes=est.build_bytes,
                              stages=[as_json(stage) for stage in est.stages])))
    else:
        print(est)
    return 0


def _print_pipe_rows(model, memory: int, args, runtime: int, propose: bool) -> bool:
    """The pipe x shard layouts (Note [pipe estimate]) and, with `propose` (nothing flat fits), the cheapest
    that fits as the one to use; True when one fits and was proposed."""
    try:
        options = plan_pipe(model, memory, args.world_size, optimizer=args.optimizer, runtime=runtime)
    except ShardwiseError as error:  # not a chain of layers: no pipeline to weigh
        if not propose:
            print(f"pipe x shard: not weighed ({error})")
        return False
    fitting = [est for est, fits in options if fits]
    if propose and not fitting:
        return False
    best = fitting[0] if propose else None
    print("pipe x shard (shardwise.pipeline, stages sharded, zero3 with keep_gathered=False; activations not "
          "counted):")
    width = max((len(est.label) for est, _ in options), default=0) + 2
    for est, fits in options:
        mark = "fits  <- cheapest that fits" if est is best else ("fits" if fits else "does not fit")
        print(f"  {est.label:<{width}}{est.total / MIB:>10,.0f} MiB   {mark}")
    if best is None:
        return False
    regather = ", keep_gathered=False" if best.strategy == "zero3" else ""
    print(f'use: PipelineConfig(num_stages={best.num_stages}, strategy="{best.strategy}"{regather}) with the model '
          "built under sw.deferred_init() (docs/pipeline.md): each rank materializes its stage's rows only")
    return True


def _fits_with_recompute(model, memory: int, margin: float, extra: dict, args):
    """The cheapest option that fits once activations are checkpointed, when the plan was made without
    it and the batch's activations are counted; else None."""
    if args.checkpoint_activations or not args.batch:
        return None
    options = plan(model, memory, args.world_size, optimizer=args.optimizer, batch=args.batch, seq=args.seq,
                   offload_dir=args.offload_dir, checkpoint_activations=True, margin=margin, **extra)
    return next((o for o in options if o.fits and o.strategy != "ddp"), None)


def _units_summary(model: nn.Module, units) -> str:
    """'12 x GPT2Block + the root (4% of parameters)': what the units cut, in a line."""
    rows = describe(model, units).rows
    kinds: dict[str, int] = {}
    for row in rows[1:]:
        kinds[row.kind] = kinds.get(row.kind, 0) + 1
    total = sum(row.numel for row in rows) or 1
    cut = " + ".join(f"{count} x {kind}" for kind, count in kinds.items()) or "no units"
    return f"{cut} + the root ({rows[0].numel / total:.0%} of parameters)"


# ---- `shardwise units` -----------------------------------------------------------------


def add_units_command(commands) -> None:
    """Add `units`: the unit plan of a model as a table (sw.describe)."""
    units = commands.add_parser(
        "units", help="the units shard() would cut MODEL into, as a table (sw.describe)",
        description="Print the unit plan of MODEL (built on the meta device: nothing is allocated): each "
                    "unit's path, module class, parameters, share, full MiB, MiB per rank at --world-size, "
                    "and the shared or tied parameters it owns.")
    _add_model(units)
    units.add_argument("--units", default="auto", metavar="UNITS",
                       help="'auto' (default), a block class name, or comma-separated module names")
    units.add_argument("--world-size", type=int, default=1, help="ranks, for MiB per rank (default: 1)")


def run_units(args) -> int:
    """Run `shardwise units MODEL`."""
    try:
        model, default = build_model(model_spec(args), args.overrides)
        print(describe(model, _units(model, args.units, default), args.world_size))
        return 0
    except ShardwiseError as error:
        print(f"shardwise units: {error}", file=sys.stderr)
        return 2

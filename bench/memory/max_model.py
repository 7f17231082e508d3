"""Benchmark: the largest GPT each configuration trains within a fixed per-rank memory budget.

    python bench/memory/max_model.py                  # world size 4, 2 GiB of RSS per rank (~20 min here)
    python bench/memory/max_model.py --quick          # 1 GiB per rank, fewer probes (a few minutes)
    python bench/memory/max_model.py --budget 3GiB --configs zero3,zero3_bf16
    python bench/memory/max_model.py --resume --redo --configs zero3   # re-measure one row, keep the rest
    python bench/memory/max_model.py --resume --configs zero3_oib,zero3_bf16_oib   # add the optimizer-in-backward rows
    python bench/memory/max_model.py --verify --configs fsdp2,zero3,zero3_offload,ds_zero3   # predict, then verify
    python bench/memory/max_model.py --configs pipe2_zero3,pipe2_whole --out /tmp/mm   # the pipeline rows (issue 46),
    python bench/memory/max_model.py --merge /tmp/mm                                    # then added to the results
    python bench/memory/max_model.py --resume \
        --configs zero3_lowbit,zero3_ac,zero3_bf16_lowbit_ac,zero3_bf16_oib_ac,ds_zero3   # options, DeepSpeed ZeRO-3
    python bench/memory/max_model.py --verify --configs fsdp2,zero3,zero3_bf16_oib_lowbit_ac   # the 2x row (issue 61)

At a fixed width, the scan looks for the deepest GPT (so the most parameters) with which
every rank of a configuration trains 3 AdamW steps without its peak RSS (ru_maxrss)
exceeding the budget: torch DDP, FSDP2 `fully_shard` (per Block, then the root),
shardwise ddp/zero1/zero2/zero3, zero3 + bf16, zero3 + disk offload, zero3 (+ bf16) + optimizer in backward,
shardwise.pipeline at 2 stages: zero3-sharded stages and the whole-copy route (Note [pipeline arms],
max_model_pipe.py), and the options people turn on, alone and combined (torchao's 8-bit AdamW, activation
checkpointing, with bf16 and optimizer in backward), and DeepSpeed ZeRO-3 (Note [option arms],
max_model_options.py), each with its loss against fp32 AdamW at one depth (--loss-layers). `sw.estimate` picks
the first candidate depth; each probe then runs in fresh processes (torchrun, gloo, one
thread per rank) and the search brackets the answer (Note [search]). Writes
bench/memory/results/max_model.{json,md,png}.

Note [allocator]: glibc malloc keeps freed blocks resident, so on CPU a sharded
strategy's savings would not show in RSS; every rank runs with MALLOC_MMAP_THRESHOLD_=65536
(blocks over 64 KiB are mmap'd and returned to the system on free).

Note [first run]: each probe's ranks get a fresh TORCHINDUCTOR_CACHE_DIR (unless --inductor-cache names one; not
the launcher's environment, where torch sets the variable to its default once anything asks inductor), so a row
that compiles (torchao's low-bit step) measures a machine's first run, compiling from nothing, as sw.estimate
counts it (Note [low-bit estimate]); with inductor's default cache, warm from earlier probes, the 8-bit row
peaked 35 MiB lower at 40 blocks (bench/memory/results/estimate_gap.md).

Note [init]: torch DDP and shardwise ddp build the model eagerly (they hold it whole
anyway). shardwise zero* build it under `sw.deferred_init()` when this version has it, so
no rank ever holds the full model; FSDP2 uses its own documented equivalent (build on
the meta device, `fully_shard`, `to_empty`, then initialize the local shards).

Note [search]: the first probe is the estimator's deepest model within the budget, found by the
search `shardwise plan --max-model` runs (sw.max_model's largest_fitting; the table's "estimator's
depth"); the estimator's slope through 8 and 16 blocks (_SLOPE_DEPTHS) steers the later probes.
A probe that fits raises the lower bound, one that does not (over budget, or crashed) lowers the upper bound. A probe
runs to its end unless a rank passes `--kill-at` budgets, so its true peak RSS is known,
and the next depth is where a line through the last two measured peaks (or one peak and
the estimator's bytes per block) meets the budget, kept strictly between the bounds. The
search ends when no depth is left between them or after `--max-runs` probes; the table
shows the bracket. zero3 + offload stops once it fits `--offload-cap` × zero3's
parameters (reported as "≥"), to bound run time (its depth, over 500 blocks at 2 GiB, takes half an hour a probe).

Note [predict then verify]: with --verify the search tests the prediction instead of using it as a start: the
first probe is sw.max_model's depth N (it must fit), the second N+1 (it must be over; N-1, which must fit, when N
was over; neither when N's peak is more than a block's bytes from the budget: the prediction missed, and the secant
steers from there); only when the prediction misses does the search go on (the secant above, to a bracket of one block,
at most --max-runs probes). The table then holds the predicted and the measured maximum, their difference, and
the estimator's error at the measured maximum (estimated − measured peak, over the measured peak).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
from bench.common.launch import rss_bytes, run_logged  # noqa: E402
from bench.memory.max_model_options import (  # noqa: E402
    OPTION_CONFIGS,
    attach_loss_reference,
    build_fsdp2,
    build_option,
    estimate_options,
    loss_at_depth,
)
from bench.memory.max_model_options import env as option_env  # noqa: E402
from bench.memory.max_model_options import unavailable as option_unavailable  # noqa: E402
from bench.memory.max_model_pipe import PIPE_CONFIGS, PIPELINES, build_pipeline, estimated_pipe_total  # noqa: E402
from bench.memory.max_model_report import markdown, plot  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MIB, GIB = 2**20, 2**30
# config: (label, estimator strategy, precision, offload)
CONFIGS = {
    "torch_ddp": ("torch DDP", "ddp", "fp32", False),
    "fsdp2": ("FSDP2 fully_shard", "zero3", "fp32", False),
    "ddp": ("shardwise ddp", "ddp", "fp32", False),
    "zero1": ("shardwise zero1", "zero1", "fp32", False),
    "zero2": ("shardwise zero2", "zero2", "fp32", False),
    "zero3": ("shardwise zero3", "zero3", "fp32", False),
    **PIPE_CONFIGS,  # Note [pipeline arms], max_model_pipe.py
    **OPTION_CONFIGS,  # Note [option arms], max_model_options.py: bf16, offload, optimizer in backward, low-bit
}  # AdamW, checkpointing, combined; DeepSpeed ZeRO-3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", default=None, help="peak RSS per rank, e.g. 2GiB (default: 2GiB; --quick: 1GiB)")
    p.add_argument("--quick", action="store_true", help="a 1 GiB budget (about 40%% of the default's run time)")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {','.join(CONFIGS)}")
    p.add_argument("--d-model", type=int, default=512, help="fixed width; the scan varies depth (default: 512)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (default: 32)")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step (default: 1)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-runs", type=int, default=None,
                   help="probes per config (default: 2: the estimator's depth, then where its measured peak points; "
                        "--verify: 6)")
    p.add_argument("--verify", action="store_true",
                   help="predict, then verify (Note [predict then verify]): probe sw.max_model's depth N and N+1 "
                        "(or N-1 when N is over), searching further only when the prediction misses")
    p.add_argument("--offload-cap", type=float, default=2.2,
                   help="stop zero3 + offload once it fits this many times zero3's parameters (default: 2.2)")
    p.add_argument("--offload-dir", default=None, help="where offload files go (default: a temporary dir)")
    p.add_argument("--kill-at", type=float, default=1.25,
                   help="stop a probe once a rank's RSS passes this many budgets; below it a probe runs to "
                        "the end, so its true peak guides the next depth (default: 1.25)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before one probe is killed")
    p.add_argument("--loss-layers", type=int, default=8,
                   help="each row's loss against fp32 AdamW is measured at this depth, unbudgeted (Note [option "
                        "arms]); 0: not measured (default: 8)")
    p.add_argument("--inductor-cache", default=None, metavar="DIR",
                   help="the ranks' TORCHINDUCTOR_CACHE_DIR (default: a fresh one per probe, a machine's first run: "
                        "Note [first run])")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--resume", action="store_true",
                   help="start from the probes in OUT/max_model.json (same settings): each config in "
                        "--configs gets --max-runs more probes; the others keep their earlier rows")
    p.add_argument("--redo", action="store_true",
                   help="with --resume: forget the earlier probes of the configs in --configs (after a "
                        "change to the code they measure) and search them again from the start")
    p.add_argument("--report", action="store_true",
                   help="run nothing: rewrite OUT/max_model.{md,png} from OUT/max_model.json, with the "
                        "estimates recomputed by this version's sw.estimate")
    p.add_argument("--merge", default=None, metavar="DIR",
                   help="run nothing: add the rows of DIR/max_model.json (made with the same settings, e.g. "
                        "by --out DIR --configs ...) to OUT's, replacing rows of the same configs, and rewrite "
                        "OUT/max_model.{md,png} without recomputing the estimates")
    # Set by the launcher only.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    p.add_argument("--num-params", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from shardwise.cli.estimate import parse_bytes

    args.budget_bytes = args.budget_bytes or parse_bytes(args.budget or ("1GiB" if args.quick else "2GiB"))
    args.max_runs = args.max_runs or (6 if args.verify else 2)
    return args


def gpt_config(args, layers: int):
    from shardwise.models.gpt import GPTConfig

    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=layers,
                     n_heads=max(1, args.d_model // 64))


# ---- one rank ----------------------------------------------------------------------


def _watch_rss(budget: int, out_dir: str, rank: int) -> None:
    """Stop this rank the moment its RSS passes `budget` (here the launcher's budget times
    `--kill-at`): the probe has failed by far, and the rest of it would only spend time.
    A probe that ends is judged by ru_maxrss against the budget itself."""
    def watch():
        while True:
            rss = rss_bytes("VmRSS")
            if rss > budget:
                Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "over_budget": True,
                                                                         "peak_rss_bytes": rss}))
                os._exit(17)
            time.sleep(0.02)
    threading.Thread(target=watch, daemon=True).start()


def build(args, rank: int, world_size: int):
    """The model, the callable to train and its optimizer, per Note [init]."""
    import shardwise as sw
    from shardwise.models.gpt import GPT, Block

    cfg = gpt_config(args, args.layers)
    torch.manual_seed(0)
    adamw = dict(lr=1e-4, weight_decay=0.1)
    if args.config == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(GPT(cfg))  # torch's defaults, as a user writes it
        return module, torch.optim.AdamW(module.parameters(), **adamw), "eager"
    if args.config == "fsdp2":
        return build_fsdp2(cfg, world_size, adamw)
    if args.config in PIPELINES:
        return build_pipeline(args, cfg, world_size, adamw)
    if args.config in OPTION_CONFIGS:
        return build_option(args, cfg, args.config, rank, adamw)
    if args.config == "ddp":
        model = sw.shard(GPT(cfg), strategy="ddp")
        return model, torch.optim.AdamW(model.parameters(), **adamw), "eager"
    deferred = hasattr(sw, "deferred_init")
    if deferred:
        with sw.deferred_init():
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    sw.shard(model, strategy=CONFIGS[args.config][1], units=Block)
    return model, torch.optim.AdamW(model.parameters(), **adamw), "deferred" if deferred else "eager"


def run_worker(args) -> None:
    rank = int(os.environ.get("RANK", 0))
    Path(args.out_dir, f"pid{rank}").write_text(str(os.getpid()))  # the launcher kills by pid on a timeout
    torch.set_num_threads(1)
    _watch_rss(int(args.budget_bytes * args.kill_at), args.out_dir, rank)
    import torch.distributed as dist

    import shardwise as sw

    sw.init()
    world_size = dist.get_world_size()
    rss_runtime = rss_bytes("VmRSS")
    started = time.perf_counter()
    module, optimizer, init = build(args, rank, world_size)
    built_s = time.perf_counter() - started
    rss_built = rss_bytes("VmRSS")
    num_params = args.num_params
    gen = torch.Generator().manual_seed(1000 + rank)
    losses, step_s, rss_steps = [], [], []
    for _ in range(args.steps):
        tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=gen)
        start = time.perf_counter()
        if optimizer is None:  # a pipeline: its trainer runs the whole step (Note [pipeline arms])
            losses.append(module())
            step_s.append(time.perf_counter() - start)
            continue
        loss = module(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
        rss_steps.append(rss_bytes("VmRSS"))  # after each step: what stays (bench/memory/estimate_gap.py)
    record = {"rank": rank, "num_params": num_params, "init": init, "losses": losses, "step_s": step_s,
              "build_s": built_s, "rss_runtime_bytes": rss_runtime, "rss_built_bytes": rss_built,
              "rss_steps_bytes": rss_steps,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    dist.barrier()
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


# ---- launcher ----------------------------------------------------------------------


def num_params_of(args, layers: int) -> int:
    d, v = args.d_model, args.vocab
    block = 12 * d * d + 10 * d  # qkv (no bias), attn_proj, mlp with biases, two LayerNorms
    return v * d + args.seq * d + layers * block + 2 * d


def estimated_total(args, config: str, layers: int) -> int:
    """sw.estimate's per-rank total for `config` at `layers` (torch DDP: plus its own gradient
    buckets, which it keeps apart from the gradients by default)."""
    import shardwise as sw
    from shardwise.models.gpt import GPT

    _, strategy, precision, offload = CONFIGS[config]
    with torch.device("meta"):
        model = GPT(gpt_config(args, layers))
    if config == "pipe2_zero3":  # Note [pipeline arms]
        return estimated_pipe_total(model, args.world_size)
    est = sw.estimate(model, strategy, args.world_size, precision, offload="disk:/tmp" if offload else None,
                      batch=args.batch, seq=args.seq, **estimate_options(config))
    return est.total + (est.gradients if config == "torch_ddp" else 0)


def predicted_layers(args, config: str) -> tuple[int, int]:
    """Note [search]: the estimator's deepest model within the budget, and its total: the search `shardwise plan
    --max-model` runs (sw.max_model, Note [largest search]), on this config's estimate."""
    from shardwise.estimate.largest import largest_fitting

    totals: dict[int, int] = {}
    layers = largest_fitting(lambda depth: estimated_total(args, config, depth), args.budget_bytes, totals=totals)
    layers = layers or 1  # not even one block within the budget: probe one (it will say by how much)
    return layers, totals.get(layers) or estimated_total(args, config, layers)


# The estimator is affine in depth only once a few units exist (from 1 to 2 blocks it adds the
# second gathered unit's buffers too: 52 MiB against 12 per block after), so the line goes
# through two deeper points.
_SLOPE_DEPTHS = (8, 16)


def _affine(args, config: str) -> tuple[int, int]:
    """(bytes at depth 0, bytes per block) of the estimator's line through _SLOPE_DEPTHS: the slope that
    steers the probes (Note [search])."""
    low, high = _SLOPE_DEPTHS
    at_low, at_high = estimated_total(args, config, low), estimated_total(args, config, high)
    per_layer = (at_high - at_low) // (high - low)
    return at_low - low * per_layer, per_layer


def probe(args, config: str, layers: int) -> dict:
    """Run `config` at depth `layers` on fresh ranks; say whether every rank stayed in budget."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",  # Note [allocator]
               **option_env(config))
    started = time.time()
    with tempfile.TemporaryDirectory() as out_dir, tempfile.TemporaryDirectory(dir=args.offload_dir) as off:
        env["TORCHINDUCTOR_CACHE_DIR"] = args.inductor_cache or str(Path(out_dir, "inductor"))  # Note [first run]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world_size}",
               __file__, "--worker", "--config", config, "--layers", str(layers), "--out-dir", out_dir,
               "--budget-bytes", str(args.budget_bytes), "--kill-at", str(args.kill_at), "--offload-dir", off,
               "--num-params",
               str(num_params_of(args, layers))]
        for flag in ("d_model", "vocab", "seq", "batch", "steps"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        error, log = run_logged(cmd, env, out_dir, args.timeout)  # kills stray ranks on a timeout
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
        tail = log[-2000:]
    over = [r for r in ranks if r.get("over_budget") or r["peak_rss_bytes"] > args.budget_bytes]
    result = {"layers": layers, "num_params": num_params_of(args, layers), "wall_s": time.time() - started,
              "ranks": sorted(ranks, key=lambda r: r["rank"])}
    if over:
        result["verdict"] = "over budget"
    elif error or len(ranks) < args.world_size:
        result.update(verdict="failed", error=error or "a rank wrote no result", output_tail=tail)
    else:
        result["verdict"] = "fits"
    if ranks:
        result["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in ranks)
    return result


def search(args, config: str, cap_params: int | None, log, earlier: list[dict] = ()) -> dict:
    """Note [search]. `earlier`: probes of a previous run (--resume), counted as if just made."""
    predicted, predicted_total = predicted_layers(args, config)
    per_layer = _affine(args, config)[1]
    layers_per_param = 1 / (num_params_of(args, 1) - num_params_of(args, 0))
    cap_layers = None
    if cap_params is not None:
        cap_layers = max(1, math.ceil((cap_params - num_params_of(args, 0)) * layers_per_param))
    fit, fail, probes, measured = None, None, [], []
    nxt = min(predicted, cap_layers or predicted)
    pending = list(earlier)
    while pending or len(probes) - len(earlier) < args.max_runs:
        if pending:
            result = pending.pop(0)
            nxt = result["layers"]
        else:
            result = probe(args, config, nxt)
            result["estimated_total_bytes"] = estimated_total(args, config, nxt)
        probes.append(result)
        log(f"  {config} L={nxt} ({result['num_params'] / 1e6:.0f}M): {result['verdict']}, peak RSS "
            f"{result.get('peak_rss_bytes', 0) / MIB:.0f} MiB (estimated {result['estimated_total_bytes'] / MIB:.0f}), "
            f"{result['wall_s']:.0f} s" + (" (earlier run)" if result in earlier else ""))
        if result["verdict"] == "fits":
            fit = nxt if fit is None else max(fit, nxt)
            if cap_layers is not None and nxt >= cap_layers:
                break
        else:
            fail = nxt if fail is None else min(fail, nxt)
        if "peak_rss_bytes" in result:
            measured.append((nxt, result["peak_rss_bytes"]))
        nxt = _next_depth(args, measured, per_layer, fit, fail, cap_layers)
        if args.verify and len(probes) == 1 and not pending and _near(args, result, per_layer):
            nxt = predicted + 1 if fit is not None else (predicted - 1 or None)  # Note [predict then verify]
        if nxt is None and not pending:
            break
    best = next((p for p in probes if p["layers"] == fit), None)
    capped = bool(cap_layers is not None and fit is not None and fit >= cap_layers)
    return {"config": config, "label": CONFIGS[config][0], "predicted_layers": predicted, "verify": args.verify,
            "predicted_params": num_params_of(args, predicted), "predicted_total_bytes": predicted_total,
            "max_layers": fit, "max_params": best["num_params"] if best else None, "first_fail_layers": fail,
            "capped": capped, "init": best["ranks"][0].get("init") if best else None,
            "peak_rss_bytes": best.get("peak_rss_bytes") if best else None, "probes": probes}


def _near(args, result: dict, per_layer: int) -> bool:
    """Whether a probe's peak is within one block's bytes of the budget: then its neighbour tests the prediction
    (Note [predict then verify]); farther, the prediction missed and the secant steers."""
    return "peak_rss_bytes" in result and abs(result["peak_rss_bytes"] - args.budget_bytes) <= per_layer


def _next_depth(args, measured, per_layer, fit, fail, cap_layers) -> int | None:
    """The depth where the measured peaks say the budget is reached (a secant through the last
    two probes, or the estimator's per-layer bytes through one), kept strictly between the
    bounds; None when no depth is left between them (Note [search])."""
    if not measured:  # only crashes so far: no peak to steer by
        return None if fail == 1 else ((fail - 1) if fit is None else (fit + fail) // 2)
    (l1, p1) = measured[-1]
    slope = per_layer
    if len(measured) >= 2 and measured[-2][0] != l1:
        l0, p0 = measured[-2]
        slope = max((p1 - p0) / (l1 - l0), per_layer / 4)  # guard against noise flattening it
    target = l1 + math.floor((args.budget_bytes - p1) / slope)
    low = (fit or 0) + 1
    high = (fail - 1) if fail is not None else None
    if cap_layers is not None:
        high = cap_layers if high is None else min(high, cap_layers)
    if high is not None and low > high:
        return None
    target = max(low, target if high is None else min(high, target))
    return target


def merge_rows(args) -> None:
    """--merge: DIR's rows into OUT's report, the estimates as each run recorded them."""
    mine, theirs = (json.loads(Path(d, "max_model.json").read_text()) for d in (args.out, args.merge))
    differ = [k for k in _SAME if mine["settings"].get(k) != theirs["settings"].get(k)]
    if differ:
        sys.exit(f"--merge: {args.merge} was made with other settings ({', '.join(differ)})")
    added = {row["config"]: row for row in theirs["rows"]}
    rows = [added.pop(row["config"], row) for row in mine["rows"]] + list(added.values())
    rows.sort(key=lambda row: list(CONFIGS).index(row["config"]))
    meta = dict(mine["meta"], merged=sorted({row["config"] for row in theirs["rows"]}))
    out = Path(args.out)
    (out / "max_model.json").write_text(json.dumps({"settings": mine["settings"], "meta": meta, "rows": rows},
                                                   indent=1))
    (out / "max_model.md").write_text(markdown(rows, args, meta))
    plot(rows, args, out / "max_model.png")
    print((out / "max_model.md").read_text())


def run_launcher(args) -> None:
    if args.merge:
        return merge_rows(args)
    configs = [] if args.report else [c for c in args.configs.split(",") if c]
    args.resume = args.resume or args.report
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        sys.exit(f"--configs: unknown {sorted(unknown)}; pick from {','.join(CONFIGS)}")
    has_offload = _has_offload()
    started = time.time()
    rows, by = [], {}
    earlier = _earlier_rows(args) if args.resume else {}
    for config in sorted(set(configs) | set(earlier), key=list(CONFIGS).index):  # zero3 before its offload
        if config not in configs:  # --resume: kept as it was
            rows.append(earlier[config])
            by[config] = earlier[config]
            continue
        why = option_unavailable(config)
        if why:
            rows.append({"config": config, "label": CONFIGS[config][0], "unavailable": f"not available: {why}"})
            print(f"{config}: not available ({why})", flush=True)
            continue
        if config == "zero3_offload" and not has_offload:
            rows.append({"config": config, "label": CONFIGS[config][0], "unavailable":
                         "not available: this version's sw.shard has no offload="})
            print(f"{config}: not available (sw.shard has no offload=)", flush=True)
            continue
        cap = None
        if config == "zero3_offload" and by.get("zero3", {}).get("max_params"):
            cap = int(args.offload_cap * by["zero3"]["max_params"])
        print(f"{config} ({time.time() - started:.0f} s in)", flush=True)
        kept = [] if args.redo else earlier.get(config, {}).get("probes", [])
        row = search(args, config, cap, lambda text: print(text, flush=True), kept)
        row["wall_s"] = sum(p["wall_s"] for p in row["probes"])
        if args.loss_layers and config not in PIPELINES:  # Note [option arms]: the loss column, one depth for all
            row["loss_at_depth"] = loss_at_depth(args, config, probe)
        rows.append(row)
        by[config] = row
        write_results(args, rows, started, has_offload)  # after every config: a crash keeps the rest
    if configs and args.loss_layers and any(r.get("loss_at_depth") for r in rows):  # Note [option arms]
        attach_loss_reference(rows, by.get("zero3", {}).get("loss_at_depth") or loss_at_depth(args, "zero3", probe))
    print(write_results(args, rows, started, has_offload))


_SAME = ("budget_bytes", "world_size", "d_model", "vocab", "seq", "batch", "steps")


def _earlier_rows(args) -> dict:
    """--resume: the rows of the last run, by config, if it used the same settings."""
    path = Path(args.out, "max_model.json")
    earlier = json.loads(path.read_text())
    differ = [k for k in _SAME if earlier["settings"].get(k) != getattr(args, k)]
    if differ:
        sys.exit(f"--resume: {path} was made with other settings ({', '.join(differ)})")
    rows = {row["config"]: row for row in earlier["rows"] if "unavailable" not in row}
    for config, row in rows.items():  # the estimator may have changed since: recompute its figures
        row["predicted_layers"], row["predicted_total_bytes"] = predicted_layers(args, config)
        row["predicted_params"] = num_params_of(args, row["predicted_layers"])
        for result in row["probes"]:
            result["estimated_total_bytes"] = estimated_total(args, config, result["layers"])
    return rows


def write_results(args, rows: list[dict], started: float, has_offload: bool) -> str:
    import shardwise as sw

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items()
                if k not in ("worker", "config", "layers", "out_dir", "num_params", "resume", "redo", "report")}
    meta = {"torch": torch.__version__, "cpus": os.cpu_count(), "wall_s": time.time() - started,
            "deferred_init": hasattr(sw, "deferred_init"), "offload": has_offload,
            "allocator": "MALLOC_MMAP_THRESHOLD_=65536"}
    (out / "max_model.json").write_text(json.dumps({"settings": settings, "meta": meta, "rows": rows}, indent=1))
    table = markdown(rows, args, meta)
    (out / "max_model.md").write_text(table)
    plot(rows, args, out / "max_model.png")
    return table


def _has_offload() -> bool:
    """Whether the shardwise under test takes `offload=` (this script also measures older checkouts)."""
    import inspect

    from shardwise import shard

    return "offload" in inspect.signature(shard).parameters


if __name__ == "__main__":
    cli = parse_args()
    run_worker(cli) if cli.worker else run_launcher(cli)

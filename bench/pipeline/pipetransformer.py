"""Benchmark: progressive freezing + activation cache + re-packing (PipeTransformer) against
a plain pipeline + data parallel, on the same GPT, data and seed, in one run.

    python bench/pipeline/pipetransformer.py                       # 3 whole runs, ~2-3 min each on 2 CPU cores
    python bench/pipeline/pipetransformer.py --epochs 2 --samples 256 --runs 1 --out /tmp/pt   # smoke run

Without `--worker` the script is the launcher: it starts `--nproc` ranks under
`torch.distributed.run`, waits, and writes bench/pipeline/results/pipetransformer.{json,md,png}.
With `--worker` it is one rank: it builds two trainers on the same ranks, (a) "plain"
(a fixed `--stages`-stage pipeline; the other factor of the world size is data-parallel
replicas) and (b) "freeze" (PipeTransformer's automatic freeze rule, the activation
cache and re-packing), and alternates them epoch by epoch, so a burst of load on this
shared machine hits both alike. Data: the Python standard library's source text,
character level (bytes), non-overlapping windows; the last `--eval-samples` windows are
held out and the eval loss after each epoch is computed outside the timed region.

Note [fine-tuning]: PipeTransformer's setting (and its no-accuracy-loss claim) is
fine-tuning a pre-trained ViT or BERT, whose lower layers have already converged. So
by default both runs start from the same GPT pre-trained here first (untimed, plain
pipeline, `--pretrain-epochs` over the `--pretrain-samples` windows that precede the
fine-tuning windows: other files of the standard library), then train `--epochs` on
their own windows with a fresh optimizer. `--pretrain-epochs 0` trains from scratch (the
rule then freezes layers that still have far to go); the report states only what its own
runs measured. The freeze schedule, and so the speedup, varies from run to run: `--runs`
whole runs (default 3), run i with seed `--seed` + i (Note [a seed per run]), reported as the
median run's table and every run's speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2: this machine has 2 cores)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages of the plain run and at the start")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--pretrain-samples", type=int, default=4096, help="windows of the untimed pre-training")
    p.add_argument("--pretrain-epochs", type=int, default=3, help="0: both runs train from scratch")
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument("--samples", type=int, default=1024, help="training windows of the compared runs")
    p.add_argument("--eval-samples", type=int, default=256, help="held-out windows")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--micro", type=int, default=4, help="micro-batches per replica per step")
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    p.add_argument("--strategy", default=None, choices=["zero1", "zero2", "zero3"],
                   help="shard each stage's layers over its data-parallel ranks (default: whole copies)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW lr of the compared runs")
    p.add_argument("--threshold", type=float, default=0.2, help="freeze rule: gradient-norm change rate")
    p.add_argument("--alpha", type=float, default=0.5, help="freeze rule: most of the active layers frozen per epoch")
    p.add_argument("--max-frozen", type=int, default=None,
                   help="freeze rule: most layers ever frozen (default: layers // 2 + 1, the embedding and half "
                        "the blocks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS), help="directory for pipetransformer.{json,md,png}")
    p.add_argument("--runs", type=int, default=3, help="whole runs; the report gives their median speedup and spread")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one rank ----------------------------------------------------------------------


def load_windows(args) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping (seq + 1)-byte windows of the standard library's source: inputs and
    next-byte targets; pre-training windows first, then training, then held-out ones."""
    from shardwise.demo import load_text

    total = args.pretrain_samples + args.samples + args.eval_samples
    text = load_text(max_bytes=total * args.seq + 1)
    if len(text) < total * args.seq + 1:
        raise SystemExit(f"the standard library has only {len(text)} bytes; ask for fewer samples")
    windows = text[: total * args.seq + 1]
    return windows[:-1].view(total, args.seq), windows[1:].view(total, args.seq)


def data_digest(args) -> str:
    import hashlib

    inputs, targets = load_windows(args)
    return hashlib.sha256(inputs.to(torch.uint8).numpy().tobytes() + targets[-1:].to(torch.uint8).numpy().tobytes()
                          ).hexdigest()


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def new_gpt(args, values: dict | None = None):
    from shardwise.models.gpt import GPT, GPTConfig

    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=256, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                          n_heads=args.heads))
    if values is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(values[name])
    return model


def build_trainer(args, inputs, targets, *, freeze: bool, lr: float, init: dict | None = None):
    from shardwise.pipeline import FreezePolicy, PipelineConfig, PipeTrainer, chain_layers, grouped_adamw

    model = new_gpt(args, init)
    config = PipelineConfig(num_stages=args.stages, num_microbatches=args.micro, schedule=args.schedule,
                            balance="params", repack=freeze, cache=freeze, strategy=args.strategy)
    max_frozen = args.max_frozen if args.max_frozen is not None else args.layers // 2 + 1
    policy = FreezePolicy(threshold=args.threshold, alpha=args.alpha, max_frozen=max_frozen) if freeze \
        else FreezePolicy()
    return PipeTrainer(chain_layers(model), gpt_loss, grouped_adamw(lr=(lr, lr)), inputs, targets,
                       global_batch_size=args.batch, config=config, freeze=policy, seed=args.seed), model


def trained_model(args, trainer, model):
    """The model to evaluate, every rank's up to date (a collective): the trainer's own on the whole-copy route;
    sharded stages train the model's rows or, after a re-pack, fresh layers, so a new GPT of their values."""
    values = trainer.full_parameters()
    return model if args.strategy is None else new_gpt(args, values)


def eval_loss(model, inputs, targets) -> float:
    with torch.no_grad():
        return sum(model(x, y).item() for x, y in zip(inputs.split(64), targets.split(64))) / len(inputs.split(64))


def pretrain_model(args, inputs, targets, eval_x, eval_y) -> tuple[dict | None, dict]:
    """Note [fine-tuning]: the untimed common start of both runs (None: from scratch)."""
    if args.pretrain_epochs == 0:
        return None, {}
    trainer, model = build_trainer(args, inputs, targets, freeze=False, lr=args.pretrain_lr)
    start = time.perf_counter()
    losses = [trainer.train_epoch(epoch).loss for epoch in range(args.pretrain_epochs)]
    seconds = time.perf_counter() - start
    params = trainer.full_parameters()
    model = trained_model(args, trainer, model)
    summary = {"seconds": seconds, "train_losses": losses,
               "eval_loss": eval_loss(model, eval_x, eval_y) if dist.get_rank() == 0 else None}
    if dist.get_rank() == 0:
        print(f"pre-trained {args.pretrain_epochs} epochs in {seconds:.1f}s: train {losses} "
              f"eval {summary['eval_loss']:.4f}", flush=True)
    return params, summary


def run_epoch_pair(runs: dict, epoch: int) -> dict[str, dict]:
    """One epoch of each run, interleaved step by step (which run goes first alternates), so a
    burst of load on this shared machine hits both alike. A run's epoch time is the sum of
    its own steps plus its `end_epoch` (the freeze decision, any re-pack and cache carry)."""
    names = list(runs)
    seconds = dict.fromkeys(names, 0.0)
    losses = {name: [] for name in names}
    start = {name: (runs[name][0].layout, _cache_counts(runs[name][0])) for name in names}
    for i, batch in enumerate(runs[names[0]][0].sampler.batches(epoch)):  # the same batches for both
        for name in (names if i % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            losses[name].append(runs[name][0].step(batch))  # ends in an all-reduce: ranks in step
            seconds[name] += time.perf_counter() - t
    records = {}
    for name in names:
        trainer = runs[name][0]
        t = time.perf_counter()
        trainer.end_epoch()
        seconds[name] += time.perf_counter() - t
        layout, (hits, misses) = start[name]
        now_hits, now_misses = _cache_counts(trainer)
        records[name] = {"epoch": epoch, "loss": sum(losses[name]) / len(losses[name]), "seconds": seconds[name],
                         "num_frozen": layout.num_frozen, "num_stages": layout.num_stages,
                         "num_replicas": layout.num_replicas, "cache_hits": now_hits - hits,
                         "cache_misses": now_misses - misses}
    return records


def _cache_counts(trainer) -> tuple[int, int]:
    cache = trainer.cache
    return (cache.hits, cache.misses) if cache is not None else (0, 0)


def worker(args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    inputs, targets = load_windows(args)
    pre, train = args.pretrain_samples, args.pretrain_samples + args.samples
    train_x, train_y = inputs[pre:train], targets[pre:train]
    eval_x, eval_y = inputs[train:], targets[train:]
    init, pretrain = pretrain_model(args, inputs[:pre], targets[:pre], eval_x, eval_y)
    runs = {name: build_trainer(args, train_x, train_y, freeze=name == "freeze", lr=args.lr, init=init)
            for name in ("plain", "freeze")}
    records = {name: [] for name in runs}
    for epoch in range(args.epochs):
        for name, record in run_epoch_pair(runs, epoch).items():
            trainer, model = runs[name]
            evaluated = trained_model(args, trainer, model)  # every rank's up to date, for the eval (untimed)
            record["eval_loss"] = eval_loss(evaluated, eval_x, eval_y) if rank == 0 else None
            rates = trainer.policy.change_rates() if name == "freeze" else None
            record["grad_norm_change"] = [round(r, 4) for r in rates] if rates else None
            records[name].append(record)
            if rank == 0:
                print(f"epoch {epoch} {name:6s} {record['seconds']:7.2f}s train {record['loss']:.4f} "
                      f"eval {record['eval_loss']:.4f} frozen {record['num_frozen']} stages "
                      f"{record['num_stages']} x replicas {record['num_replicas']} cache hit/miss "
                      f"{record['cache_hits']}/{record['cache_misses']} rates {record['grad_norm_change']}", flush=True)
    if rank == 0:
        with open(os.path.join(args.out, "pipetransformer.worker.json"), "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "pretrain": pretrain,
                       "runs": records}, f)
    for trainer, _ in runs.values():
        if trainer.cache is not None:
            trainer.cache.close()
    dist.destroy_process_group()


# ---- launcher ----------------------------------------------------------------------


def launch(args, argv: list[str]) -> dict:
    os.makedirs(args.out, exist_ok=True)
    # "--": torchrun's parser would read our --nproc as an ambiguous abbreviation of its own --nproc-per-node.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--", __file__, "--worker", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    path = os.path.join(args.out, "pipetransformer.worker.json")
    with open(path) as f:
        data = json.load(f)
    os.remove(path)
    data["wall_seconds"] = time.perf_counter() - start
    return data


def summarize(data: dict) -> dict:
    plain, freeze = data["runs"]["plain"], data["runs"]["freeze"]
    total = {name: sum(r["seconds"] for r in recs) for name, recs in data["runs"].items()}
    ratios = [p["seconds"] / f["seconds"] for p, f in zip(plain, freeze)]
    final = {name: recs[-1]["eval_loss"] for name, recs in data["runs"].items()}
    return {
        "total_seconds": total,
        "speedup": total["plain"] / total["freeze"],
        "median_epoch_seconds": {name: statistics.median(r["seconds"] for r in recs)
                                 for name, recs in data["runs"].items()},
        "median_epoch_ratio": statistics.median(ratios),
        "final_eval_loss": final,
        "final_train_loss": {name: recs[-1]["loss"] for name, recs in data["runs"].items()},
        "eval_loss_rel_diff": (final["freeze"] - final["plain"]) / final["plain"],
    }


def write_markdown(data: dict, summary: dict, path: str, runs: list[dict]) -> None:
    a, pre = data["args"], data.get("pretrain") or {}
    start = (f"Both runs start from the same GPT pre-trained (untimed, plain pipeline) for {a['pretrain_epochs']} "
             f"epochs on the {a['pretrain_samples']} windows before theirs ({pre['seconds']:.0f} s; eval loss then "
             f"{pre['eval_loss']:.4f}), as PipeTransformer fine-tunes pre-trained models (Note [fine-tuning])."
             if pre else "Both runs train from scratch.")
    lines = [
        f"GPT (tied embedding/head) vocab 256, d_model {a['d_model']}, {a['layers']} blocks, {a['heads']} heads, "
        f"seq {a['seq']}; {a['samples']} training windows of the Python standard library's source "
        f"({a['eval_samples']} held out); global batch {a['batch']}, {a['micro']} micro-batches, "
        f"{a['schedule']}; AdamW lr {a['lr']}; {a['nproc']} ranks (gloo, 1 thread each) on a shared "
        f"2-core machine; plain = {a['stages']}-stage pipeline x {a['nproc'] // a['stages']} replica(s); "
        f"freeze = PipeTransformer rule (threshold {a['threshold']}, alpha {a['alpha']}, at most "
        f"{a['max_frozen'] if a['max_frozen'] is not None else a['layers'] // 2 + 1} of {a['layers'] + 2} layers "
        "frozen) + cache + re-packing. "
        "The two runs' steps alternate in the same ranks (which goes first alternates), so load on this "
        "shared machine hits both alike; a run's epoch time is the sum of its own steps plus its end-of-epoch "
        "freeze / re-pack / cache carry; the first epoch after a freeze includes the cache fill. Eval loss is "
        "on the held-out windows, untimed. " + start,
        "",
        "| epoch | plain s | freeze s | plain / freeze | frozen layers | stages x replicas | cache hit / miss "
        "| plain eval loss | freeze eval loss |",
        "|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for p, f in zip(data["runs"]["plain"], data["runs"]["freeze"]):
        lines.append(
            f"| {p['epoch']} | {p['seconds']:.2f} | {f['seconds']:.2f} | {p['seconds'] / f['seconds']:.2f} "
            f"| {f['num_frozen']} | {f['num_stages']} x {f['num_replicas']} | {f['cache_hits']} / {f['cache_misses']} "
            f"| {p['eval_loss']:.4f} | {f['eval_loss']:.4f} |")
    s = summary
    lines += [
        "",
        "| run | total s | median epoch s | final eval loss | final train loss |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("plain", "freeze"):
        lines.append(f"| {name} | {s['total_seconds'][name]:.1f} | {s['median_epoch_seconds'][name]:.2f} "
                     f"| {s['final_eval_loss'][name]:.4f} | {s['final_train_loss'][name]:.4f} |")
    lines += [
        "",
        f"**Speedup (total time plain / freeze): {s['speedup']:.2f}x**; median per-epoch ratio "
        f"{s['median_epoch_ratio']:.2f}x; final eval loss freeze vs plain: {100 * s['eval_loss_rel_diff']:+.2f}%.",
        "",
        "Reading it: epochs before the first freeze do identical work in both runs, so their ratio is the "
        "measurement noise. The held-out loss is the target; the training loss of the freeze run ends higher "
        "(its frozen half cannot fit the training windows as closely as the plain run, which over-fits them).",
        "",
    ]
    if len(runs) > 1:
        speedups = [r["summary"]["speedup"] for r in runs]
        lines[-1:-1] = [
            "",
            f"All {len(runs)} runs (the table above is the median one, run {runs.index(data) + 1}):",
            "",
            "| run | seed | speedup | median per-epoch ratio | eval loss freeze vs plain | frozen layers by epoch |",
            "|---:|---:|---:|---:|---:|---|",
            *[f"| {i + 1} | {r['args']['seed']} | {r['summary']['speedup']:.2f}x | "
              f"{r['summary']['median_epoch_ratio']:.2f}x | {100 * r['summary']['eval_loss_rel_diff']:+.2f}% | "
              f"{' '.join(str(e['num_frozen']) for e in r['runs']['freeze'])} |"
              for i, r in enumerate(runs)],
            "",
            f"**Median speedup over {len(runs)} runs: {statistics.median(speedups):.2f}x** "
            f"(spread {min(speedups):.2f}x to {max(speedups):.2f}x).",
        ]
    lines.insert(1, f"Data: {data['data_sha256'][:16]} (sha256 of the windows' bytes; Python {data['python']}'s "
                    "standard library, so another Python version trains on other bytes).")
    lines.insert(1, "")
    Path(path).write_text("\n".join(lines))


def write_plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_r, ax_l) = plt.subplots(1, 3, figsize=(15, 4))
    for name, marker, color in (("plain", "o", "tab:blue"), ("freeze", "s", "tab:orange")):
        recs = data["runs"][name]
        epochs = [r["epoch"] for r in recs]
        ax_t.plot(epochs, [r["seconds"] for r in recs], marker=marker, color=color, label=name)
        ax_l.plot(epochs, [r["eval_loss"] for r in recs], marker=marker, color=color, label=f"{name} (held out)")
        ax_l.plot(epochs, [r["loss"] for r in recs], marker=marker, color=color, linestyle=":", alpha=0.6,
                  label=f"{name} (train)")
    for r in data["runs"]["freeze"]:
        ax_t.annotate(f"{r['num_frozen']}f {r['num_stages']}x{r['num_replicas']}", (r["epoch"], r["seconds"]),
                      textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    plain, freeze = data["runs"]["plain"], data["runs"]["freeze"]
    ax_r.bar([p["epoch"] for p in plain], [p["seconds"] / f["seconds"] for p, f in zip(plain, freeze)],
             color="tab:green")
    ax_r.axhline(1.0, color="gray", linewidth=1)
    ax_t.set(xlabel="epoch", ylabel="wall seconds", title="time per epoch (freeze: frozen layers, stages x replicas)")
    ax_r.set(xlabel="epoch", ylabel="plain s / freeze s", title="speedup per epoch (steps interleaved)")
    ax_l.set(xlabel="epoch", ylabel="cross-entropy (nats/byte)", title="loss")
    for ax in (ax_t, ax_l):
        ax.legend()
    for ax in (ax_t, ax_r, ax_l):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    from tqdm import tqdm

    runs = []
    for i in tqdm(range(args.runs), desc="runs"):
        # Note [a seed per run]: one seed trains bitwise alike every time, so repeating it measures only the
        # timing noise; the freeze schedule (and so the speedup) is set by the seed, so each run takes its own.
        data = launch(args, [*argv, "--seed", str(args.seed + i)])  # argparse keeps the last --seed
        data["summary"] = summarize(data)
        data["data_sha256"] = data_digest(args)
        data["python"] = sys.version.split()[0]
        runs.append(data)
    data = sorted(runs, key=lambda r: r["summary"]["speedup"])[(len(runs) - 1) // 2]  # the median run
    out = Path(args.out)
    (out / "pipetransformer.json").write_text(json.dumps({"runs": runs, "median_run": runs.index(data)}, indent=1))
    write_markdown(data, data["summary"], str(out / "pipetransformer.md"), runs)
    write_plot(data, str(out / "pipetransformer.png"))
    print((out / "pipetransformer.md").read_text())


if __name__ == "__main__":
    main()

"""Benchmark: `shardwise estimate` against the measured peak RSS of Hugging Face models under zero3.

    python bench/estimate/estimator.py                          # 4 architectures x 2 batches, ws 2 (~12 min here)
    python bench/estimate/estimator.py --archs gpt2 --batches 4 # one case

For each architecture (GPT-2, BERT, Llama, T5, built from small configs) and batch, the
estimate is what `shardwise estimate --model bench/estimate/estimator.py:ARCH --strategy zero3
--world-size 2 --batch B --seq S --json` prints in a fresh process (its activations from
the probe on meta tensors, its runtime with the RSS that importing transformers and
building the model added); the measurement is 3 AdamW steps of `model(**batch).loss`
on 2 fresh gloo ranks under torchrun (one thread each, the model built under
`sw.deferred_init()` (Llama eagerly: see EAGER), `sw.shard(model, strategy="zero3")` with
units="auto"), each rank
reporting its peak RSS (ru_maxrss). Every rank runs with MALLOC_MMAP_THRESHOLD_=65536, as
bench/memory/max_model.py (Note [allocator] there): blocks over 64 KiB are mmap'd and returned to
the system on free, so RSS follows the bytes tensors hold. Writes
bench/estimate/results/estimator.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
VOCAB, WIDTH, LAYERS, HEADS, FFN = 8192, 256, 6, 4, 1024
ARCHS = ("gpt2", "bert", "llama", "t5")


# ---- the models (MODEL for `shardwise estimate`: bench/estimate/estimator.py:gpt2, ...) ------------


def gpt2():
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=512))


def bert():
    import transformers

    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=512))


def llama():
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, intermediate_size=FFN, max_position_embeddings=512))


def t5():
    import transformers

    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_ff=FFN, num_layers=LAYERS // 2, num_decoder_layers=LAYERS // 2,
        num_heads=HEADS, d_kv=WIDTH // HEADS, decoder_start_token_id=0, pad_token_id=0))


BUILDERS = {"gpt2": gpt2, "bert": bert, "llama": llama, "t5": t5}
# Built eagerly: under sw.deferred_init() Llama's rotary `inv_freq` buffer stays on meta and the
# first forward fails ("Cannot copy out of meta tensor"). These models are small, and a rank's
# whole model is freed at shard() long before the step's peak.
EAGER = ("llama",)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default=",".join(ARCHS), help=f"comma-separated, from {','.join(ARCHS)}")
    p.add_argument("--batches", default="4,12", help="samples per rank per step (default: 4,12)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sample (default: 256)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--update", action="store_true",
                   help="measure only --archs x --batches again and keep OUT/estimator.json's other rows")
    p.add_argument("--report", action="store_true",
                   help="measure nothing: estimate again (this version's estimator) for the measured cases in "
                        "OUT/estimator.json, and rewrite it and the .md and .png")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arch", help=argparse.SUPPRESS)  # a name in BUILDERS, or path/to/file.py:function
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="zero3", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)  # checkpoint_activations=True
    p.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)  # build without sw.deferred_init()
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one rank (bench/estimate/estimator_grid.py runs its cases through this worker too) -----------------


def build(arch: str):
    """The model ARCH names: one of BUILDERS, or what `path/to/file.py:function` returns."""
    if arch in BUILDERS:
        return BUILDERS[arch]()
    from shardwise.cli.models import load_function

    return load_function(arch)()


def run_worker(args) -> None:
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.estimate.inputs import call, loss_of, make_inputs
    from shardwise.estimate.measure import process_rss

    rank = int(os.environ.get("RANK", 0))
    torch.set_num_threads(1)
    sw.init()
    rss_init = process_rss()
    if args.eager or args.arch in EAGER:
        model = build(args.arch)
    else:
        with sw.deferred_init():
            model = build(args.arch)
    sw.shard(model, strategy=args.strategy, precision=args.precision, checkpoint_activations=args.recompute)
    model.train()
    rss_built = process_rss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(args.steps):
        batch = make_inputs(model, args.batch, args.seq, torch.device("cpu"))
        loss = loss_of(call(model, batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        del batch, loss
    record = {"rank": rank, "losses": losses, "rss_init_bytes": rss_init, "rss_built_bytes": rss_built,
              "rss_between_steps_bytes": process_rss(),  # runtime + model state, no step in flight
              "rss_file_bytes": process_rss("RssFile"),  # mapped files (torch's libraries): evictable
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    dist.barrier()
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    sw.shutdown()


# ---- launcher ------------------------------------------------------------------------------


def estimated(args, arch: str, batch: int) -> dict:
    """What `shardwise estimate ... --json` prints for this case, in a fresh process."""
    cmd = [sys.executable, "-m", "shardwise.cli", "estimate", "--model", f"{__file__}:{arch}", "--strategy",
           "zero3", "--world-size", str(args.world_size), "--batch", str(batch), "--seq", str(args.seq), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def measured(args, arch: str, batch: int) -> dict:
    return measure_ranks(args.world_size, ["--arch", arch, "--batch", str(batch), "--seq", str(args.seq),
                                           "--steps", str(args.steps)], args.timeout)


def measure_ranks(world: int, worker_args: list[str], timeout: float, *, mmap_threshold: bool = True) -> dict:
    """Run this file's worker on `world` fresh gloo ranks under torchrun; each rank's record and the peak.
    `mmap_threshold`: the ranks run with MALLOC_MMAP_THRESHOLD_=65536 (what the estimate assumes); False:
    glibc's default, which keeps freed blocks resident (the variable removed if the shell set it)."""
    from bench.common.launch import run_logged

    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    if not mmap_threshold:
        del env["MALLOC_MMAP_THRESHOLD_"]
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               __file__, "--worker", *worker_args, "--out-dir", out_dir]
        error, log = run_logged(cmd, env, out_dir, timeout)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    if error or len(ranks) < world:
        raise RuntimeError(f"{' '.join(worker_args)}: {error or 'a rank wrote no result'}\n{log[-2000:]}")
    return {"ranks": ranks, "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks)}


def markdown(rows: list[dict], args) -> str:
    lines = [f"`shardwise estimate` against measured peak RSS per rank (max over ranks): Hugging Face models "
             f"from small configs (vocab {VOCAB}, width {WIDTH}, {LAYERS} blocks, {HEADS} heads, FFN {FFN}; T5 "
             f"{LAYERS // 2} encoder + {LAYERS // 2} decoder blocks), seq {args.seq}, zero3, world size "
             f"{args.world_size}, units=\"auto\", fp32 AdamW, {args.steps} steps, gloo, 1 thread per rank, "
             "MALLOC_MMAP_THRESHOLD_=65536. Reproduce: `python bench/estimate/estimator.py`.", "",
             "| architecture | params | batch/rank | estimated MiB | measured MiB | error | est. activations MiB "
             "| step: est. / measured MiB | between steps: est. / measured MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        est, peak = r["estimate"], r["measured"]["peak_rss_bytes"]
        # Between steps a rank holds its runtime, parameters and optimizer state; a step adds the
        # rest (activations or gradients, the larger, and the gather buffers).
        between = est["runtime"] + est["parameters"] + est["optimizer_state"]
        held = max(x.get("rss_between_steps_bytes", 0) for x in r["measured"]["ranks"])
        lines.append(f"| {r['arch']} | {est['num_params'] / 1e6:.1f}M | {r['batch']} | {est['total'] / MIB:,.0f} | "
                     f"{peak / MIB:,.0f} | {(est['total'] - peak) / peak:+.1%} | {est['activations'] / MIB:,.0f} | "
                     f"{(est['total'] - between) / MIB:,.0f} / {(peak - held) / MIB:,.0f} | "
                     f"{between / MIB:,.0f} / {held / MIB:,.0f} |")
    worst = max(abs(r["estimate"]["total"] - r["measured"]["peak_rss_bytes"]) / r["measured"]["peak_rss_bytes"]
                for r in rows)
    lines += ["", f"Largest error: {worst:.1%} (target: 10%).", "",
              "Step: what a step adds on top of what a rank holds between steps (estimated: the larger of "
              "activations and gradients, plus the gather buffers; measured: peak RSS minus RSS after the last "
              "step). Between steps: runtime + parameters + optimizer state (estimated; the runtime row "
              "includes what importing transformers and building the model added to the estimating "
              "process) against RSS after the last step. The step is the probe's; what is over is mostly "
              "the runtime constant (330 MiB, fitted on bench/memory/max_model.py's deep GPTs)."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['arch']}\nb={r['batch']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [r["estimate"]["total"] / MIB for r in rows], 0.4, label="estimated")
    ax.bar([i + 0.2 for i in x], [r["measured"]["peak_rss_bytes"] / MIB for r in rows], 0.4, label="measured")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("peak RSS per rank (MiB)")
    ax.set_title("shardwise estimate vs measured, zero3, world size 2")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    out = Path(args.out)
    if args.report:  # the measurements kept, the estimates made again by this version
        rows = json.loads((out / "estimator.json").read_text())["rows"]
        for row in rows:
            row["estimate"] = estimated(args, row["arch"], row["batch"])
        (out / "estimator.json").write_text(json.dumps({"settings": {k: v for k, v in vars(args).items()
                                                                     if k in ("seq", "world_size", "steps")},
                                                        "rows": rows}, indent=1))
    else:
        rows = json.loads((out / "estimator.json").read_text())["rows"] if args.update else []
        for arch in args.archs.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                started = time.time()
                row = {"arch": arch, "batch": batch, "seq": args.seq, "estimate": estimated(args, arch, batch),
                       "measured": measured(args, arch, batch)}
                rows = [r for r in rows if (r["arch"], r["batch"]) != (arch, batch)] + [row]
                est, peak = row["estimate"]["total"], row["measured"]["peak_rss_bytes"]
                print(f"{arch} batch {batch}: estimated {est / MIB:,.0f} MiB, measured {peak / MIB:,.0f} MiB "
                      f"({(est - peak) / peak:+.1%}), {time.time() - started:.0f} s", flush=True)
        rows.sort(key=lambda r: (ARCHS.index(r["arch"]), r["batch"]))
        out.mkdir(parents=True, exist_ok=True)
        (out / "estimator.json").write_text(json.dumps({"settings": {k: v for k, v in vars(args).items()
                                                                     if k in ("seq", "world_size", "steps")},
                                                        "rows": rows}, indent=1))
    (out / "estimator.md").write_text(markdown(rows, args))
    plot(rows, out / "estimator.png")
    print((out / "estimator.md").read_text())


if __name__ == "__main__":
    main()

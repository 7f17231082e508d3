"""Benchmark: `shardwise estimate` against measured peak RSS per rank, with and without activation
checkpointing, for zero1/2/3 at world sizes 2 and 4, on the zoo GPT and three Hugging Face families.

    python bench/estimate/estimator_grid.py                                  # the whole grid (~40 min on 2 busy cores)
    python bench/estimate/estimator_grid.py --archs qwen2 --strategies zero3 --world-sizes 2   # a slice of it

Each case is what bench/estimate/estimator.py does for one configuration: the estimate is what `shardwise
estimate --model bench/estimate/estimator_grid.py:ARCH --strategy S --world-size W --batch B --seq S --json
[--checkpoint-activations]` prints in a fresh process; the measurement is bench/estimate/estimator.py's worker
(`--arch bench/estimate/estimator_grid.py:ARCH --eager [--recompute]`): 2 AdamW steps of the loss on W fresh
gloo ranks under torchrun (one thread each, MALLOC_MMAP_THRESHOLD_=65536, the model built eagerly,
`sw.shard(model, strategy=S, checkpoint_activations=...)` with units="auto"), each rank reporting
its peak RSS. Results are appended case by case to OUT/estimator_grid.json (a rerun
skips the cases already there), then written as OUT/estimator_grid.md and plotted in OUT/estimator_grid.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
VOCAB, WIDTH, LAYERS, HEADS, FFN, SEQ = 8192, 256, 6, 4, 1024, 256
ARCHS = ("gpt", "qwen2", "gpt_neox", "phi")


# ---- the models (MODEL for `shardwise estimate`: bench/estimate/estimator_grid.py:qwen2, ...) ----------


def gpt():
    from shardwise.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=WIDTH, n_layers=LAYERS, n_heads=HEADS))


def qwen2():
    import transformers

    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=2, intermediate_size=FFN, max_position_embeddings=512, tie_word_embeddings=True))


def gpt_neox():
    import transformers

    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=512))


def phi():
    import transformers

    return transformers.PhiForCausalLM(transformers.PhiConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=512))


BUILDERS = {"gpt": gpt, "qwen2": qwen2, "gpt_neox": gpt_neox, "phi": phi}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default=",".join(ARCHS))
    p.add_argument("--strategies", default="zero1,zero2,zero3")
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--checkpoint", default="off,on", help="activation checkpointing: off, on or both")
    p.add_argument("--batch", type=int, default=8, help="samples per rank per step (default: 8)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--reestimate", action="store_true",
                   help="measure nothing: estimate every measured case again with this version's estimator")
    return p.parse_args(argv)


# ---- launcher ------------------------------------------------------------------------------


def estimated(args, arch, strategy, world, recompute) -> dict:
    cmd = [sys.executable, "-m", "shardwise.cli", "estimate", "--model", f"{__file__}:{arch}", "--strategy", strategy,
           "--world-size", str(world), "--batch", str(args.batch), "--seq", str(SEQ), "--json"]
    done = subprocess.run(cmd + ["--checkpoint-activations"] * recompute, capture_output=True, text=True,
                          timeout=args.timeout)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def measured(args, arch, strategy, world, recompute) -> dict:
    """bench/estimate/estimator.py's worker on this file's model, built eagerly, with this strategy and
    checkpointing."""
    from bench.estimate.estimator import measure_ranks

    return measure_ranks(world, ["--arch", f"{__file__}:{arch}", "--strategy", strategy, "--batch", str(args.batch),
                                 "--seq", str(SEQ), "--steps", str(args.steps), "--eager"]
                         + ["--recompute"] * recompute, args.timeout)


def markdown(rows: list[dict], args) -> str:
    lines = [f"`shardwise estimate` against measured peak RSS per rank (max over ranks), with and without "
             f"`checkpoint_activations`: the zoo GPT and Hugging Face Qwen2, GPT-NeoX and Phi from small configs "
             f"(vocab {VOCAB}, width {WIDTH}, {LAYERS} blocks, {HEADS} heads, FFN {FFN}), seq {SEQ}, batch "
             f"{args.batch} per rank, fp32 AdamW, {args.steps} steps, units=\"auto\", gloo, 1 thread per rank, "
             "MALLOC_MMAP_THRESHOLD_=65536. Peak RSS, not time: other jobs loading the machine (load average 12-14 on "
             "2 cores for the ws-4 GPT-NeoX, Phi and Qwen2 zero3-checkpointing rows) do not change it. Reproduce: "
             "`python bench/estimate/estimator_grid.py` (a rerun measures only the cases missing from the .json).", "",
             "| model | strategy | ranks | checkpointing | estimated MiB | measured MiB | error | est. activations |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        est, peak = r["estimate"], r["measured"]["peak_rss_bytes"]
        lines.append(f"| {r['arch']} | {r['strategy']} | {r['world']} | {'on' if r['recompute'] else 'off'} | "
                     f"{est['total'] / MIB:,.0f} | {peak / MIB:,.0f} | {(est['total'] - peak) / peak:+.1%} | "
                     f"{est['activations'] / MIB:,.0f} |")
    errors = [(r["estimate"]["total"] - r["measured"]["peak_rss_bytes"]) / r["measured"]["peak_rss_bytes"]
              for r in rows]
    worst = max(range(len(rows)), key=lambda i: abs(errors[i]))
    w = rows[worst]
    lines += ["", f"Worst error: {errors[worst]:+.1%} ({w['arch']} {w['strategy']} ws {w['world']}, checkpointing "
              f"{'on' if w['recompute'] else 'off'}); {sum(abs(e) <= 0.05 for e in errors)} of {len(rows)} cases "
              "within ±5%."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Each case's error (estimated - measured) / measured, by model and world size, against the ±5% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.axhspan(-5, 5, color="0.92", label="±5%")
    groups = sorted({(r["world"], r["arch"]) for r in rows}, key=lambda g: (g[0], ARCHS.index(g[1])))
    strategies = ("zero1", "zero2", "zero3")
    for recompute, marker in ((False, "o"), (True, "^")):
        xs, ys = [], []
        for r in rows:
            if r["recompute"] == recompute:
                peak = r["measured"]["peak_rss_bytes"]
                xs.append(groups.index((r["world"], r["arch"])) + 0.25 * (strategies.index(r["strategy"]) - 1))
                ys.append(100 * (r["estimate"]["total"] - peak) / peak)
        ax.scatter(xs, ys, marker=marker, label=f"checkpointing {'on' if recompute else 'off'}")
    ax.set_xticks(range(len(groups)), [f"{arch}\nws {world}" for world, arch in groups])
    ax.set_ylabel("estimate error (% of measured peak RSS)")
    ax.set_title("shardwise estimate vs measured peak RSS per rank (zero1, zero2, zero3 left to right in each group)")
    ax.set_ylim(-8, 8)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "estimator_grid.json"
    rows = json.loads(store.read_text())["rows"] if store.exists() else []
    if args.reestimate:
        for row in rows:
            row["estimate"] = estimated(args, row["arch"], row["strategy"], row["world"], row["recompute"])
        store.write_text(json.dumps({"settings": {"batch": args.batch, "seq": SEQ, "steps": args.steps},
                                     "rows": rows}, indent=1))
        args.archs = ""  # nothing to measure
    done = {(r["arch"], r["strategy"], r["world"], r["recompute"]) for r in rows}
    for world in (int(w) for w in args.world_sizes.split(",")):
        for arch in filter(None, args.archs.split(",")):
            for strategy in args.strategies.split(","):
                for recompute in [c == "on" for c in args.checkpoint.split(",")]:
                    if (arch, strategy, world, recompute) in done:
                        continue
                    started = time.time()
                    row = {"arch": arch, "strategy": strategy, "world": world, "recompute": recompute,
                           "estimate": estimated(args, arch, strategy, world, recompute),
                           "measured": measured(args, arch, strategy, world, recompute)}
                    rows.append(row)
                    store.write_text(json.dumps({"settings": {"batch": args.batch, "seq": SEQ, "steps": args.steps},
                                                 "rows": rows}, indent=1))
                    est, peak = row["estimate"]["total"], row["measured"]["peak_rss_bytes"]
                    print(f"{arch} {strategy} ws {world} ckpt {recompute}: estimated {est / MIB:,.0f} MiB, measured "
                          f"{peak / MIB:,.0f} MiB ({(est - peak) / peak:+.1%}), {time.time() - started:.0f} s",
                          flush=True)
    (out / "estimator_grid.md").write_text(markdown(rows, args))
    plot(rows, out / "estimator_grid.png")
    print((out / "estimator_grid.md").read_text())


if __name__ == "__main__":
    main()

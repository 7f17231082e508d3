"""What compression costs in accuracy (issue 47 point 3): loss curves of the bench GPT and of a Hugging Face Llama
built from a config (transformers' LlamaForCausalLM, a tiny LlamaConfig) under zero3 with the quantized
collectives (`shard(..., compression=...)`, Note [quantized collectives]) against fp32 and bf16, several seeds,
the final gap to fp32 and its spread over seeds.

    python bench/correctness/loss_curves.py                       # ws 2, 300 steps, 3 seeds, tiny GPT and Llama
    python bench/correctness/loss_curves.py --steps 20 --seeds 1  # smoke run
    python bench/correctness/loss_curves.py --models llama                   # one model (the results hold what ran)

The Llama is `LlamaConfig(vocab_size=--vocab, hidden_size=--d-model, intermediate_size=2*--d-model,
num_hidden_layers=--layers, num_attention_heads=--heads, num_key_value_heads=--heads/2, untied head)`, sharded
with its decoder layers as units; its loss is the cross-entropy of its logits on the same shifted targets.

The data is learnable, not uniform noise (on random tokens every arm ends at ln(vocab) and no gap can show):
each sequence walks a fixed sparse transition table (every token has 4 likely successors, drawn once from
--data-seed), so the loss falls from ln(vocab) towards the table's entropy (ln 4 = 1.39 nats) and a
perturbation of the training shows as a gap. Every arm and seed sees the same batches; a seed changes the
initial weights only. The final loss is the mean of the last --tail steps' losses (averaged over ranks).
Results: bench/correctness/results/loss_curves.{md,json,png}. Counting losses, not timing: the machine's load does not
change these numbers (gloo sums in a fixed order: a rerun gives the same curves).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
from bench.common.launch import main_of, publish, run_per_world_size  # noqa: E402
from bench.common.plot import panels, save  # noqa: E402

ARMS = {  # name -> shard() keywords on top of strategy="zero3"
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "qwZ int8 + qgZ int8": {"compression": {"gather": "int8", "reduce": "int8"}},
    "qwZ int8 + qgZ int4": {"compression": {"gather": "int8", "reduce": "int4"}},
}
MODELS = {"gpt": "the bench GPT", "llama": "an HF Llama from a config"}
RESULTS = Path(__file__).resolve().parent / "results"
SUCCESSORS = 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--tail", type=int, default=20, help="steps averaged for the final loss")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-seed", type=int, default=7)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def batch(args, step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: walks of the fixed transition table (module docstring)."""
    table = torch.randint(args.vocab, (args.vocab, SUCCESSORS), generator=torch.Generator().manual_seed(args.data_seed))
    gen = torch.Generator().manual_seed(args.data_seed * 100_003 + step)
    rows = world_size * args.batch
    tokens = torch.empty(rows, args.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(args.vocab, (rows,), generator=gen)
    choices = torch.randint(SUCCESSORS, (rows, args.seq), generator=gen)
    for t in range(args.seq):
        tokens[:, t + 1] = table[tokens[:, t], choices[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


def build(args, name: str, seed: int):
    """`name`'s model with torch seeded by `seed` (the initial weights), its unit class and its loss function
    `(model, idx, targets) -> loss`."""
    torch.manual_seed(seed)
    if name == "gpt":
        from shardwise.models.gpt import GPT, Block, GPTConfig

        model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                              n_heads=args.heads))
        return model, Block, lambda m, idx, targets: m(idx, targets)
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=2 * args.d_model,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq,
                         tie_word_embeddings=False)

    def loss_of(m, idx, targets):
        logits = m(input_ids=idx).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return LlamaForCausalLM(config), LlamaDecoderLayer, loss_of


def train(args, name: str, arm: str, seed: int) -> list[float]:
    """One curve: `name` under zero3 and `arm`, each step's loss averaged over the ranks."""
    import torch.distributed as dist

    import shardwise as sw

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, unit, loss_of = build(args, name, seed)
    sw.shard(model, strategy="zero3", units=unit, **ARMS[arm])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    curve = []
    for idx, targets in ((t[mine] for t in batch(args, step, world_size)) for step in range(args.steps)):
        loss = loss_of(model, idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().float()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        curve.append(mean.item())
    return curve


def run_worker(args) -> None:
    import torch.distributed as dist

    import shardwise as sw

    torch.set_num_threads(1)
    sw.init()
    curves = {name: {arm: [train(args, name, arm, seed) for seed in range(args.seeds)] for arm in ARMS}
              for name in args.models.split(",")}
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(curves))
    dist.barrier()
    sw.shutdown()


def summary(curves: dict, tail: int) -> dict:
    """Per arm: each seed's final loss, and its gap to the same seed's fp32 run (mean, min, max)."""
    finals = {arm: [statistics.fmean(run[-tail:]) for run in runs] for arm, runs in curves.items()}
    out = {}
    for arm, values in finals.items():
        gaps = [(v - f) / f for v, f in zip(values, finals["fp32"])]
        out[arm] = {"final": values, "gap": gaps, "gap_mean": statistics.fmean(gaps), "gap_min": min(gaps),
                    "gap_max": max(gaps)}
    return out


def plot(curves: dict, path: Path) -> None:
    """One row per model: the loss (mean over seeds) and its gap to fp32."""
    fig, axes = panels(rows=len(curves))
    for (name, arms), (left, right) in zip(curves.items(), axes):
        base = [statistics.fmean(step) for step in zip(*arms["fp32"])]
        for arm, runs in arms.items():
            mean = [statistics.fmean(step) for step in zip(*runs)]
            left.plot(range(1, len(mean) + 1), mean, label=arm, linewidth=1)
            right.plot(range(1, len(mean) + 1), [(a - b) / b * 100 for a, b in zip(mean, base)], label=arm,
                       linewidth=1)
        left.set_yscale("log")
        left.set_ylabel(f"{name}: loss (mean over seeds)")
        right.set_ylabel(f"{name}: gap to fp32, % (mean over seeds)")
        for ax in (left, right):
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    seeds = len(next(iter(next(iter(curves.values())).values())))
    save(fig, path, f"zero3: quantized collectives against fp32 and bf16 ({seeds} seeds)")


def table(name: str, rows: dict) -> list[str]:
    lines = [f"## {MODELS[name]} (`{name}`)", "",
             "| arm | final loss per seed | gap to fp32, mean | gap range over seeds |", "|---|---|---:|---|"]
    for arm, row in rows.items():
        lines.append(f"| {arm} | {', '.join(f'{v:.4f}' for v in row['final'])} | {row['gap_mean'] * 100:+.2f}% | "
                     f"{row['gap_min'] * 100:+.2f}% .. {row['gap_max'] * 100:+.2f}% |")
    return lines + [""]


def run_launcher(args) -> None:
    worker_args = ["--models", args.models]
    for flag in ("steps", "seeds", "vocab", "d_model", "layers", "heads", "seq", "batch", "lr", "data_seed"):
        worker_args += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    curves = run_per_world_size(__file__, [args.world_size], worker_args)[args.world_size]
    rows = {name: summary(arms, args.tail) for name, arms in curves.items()}
    lines = [
        "# Loss curves: quantized collectives against fp32 and bf16 (issue 47 point 3)",
        "",
        f"Reproduce: `python bench/correctness/loss_curves.py --world-size {args.world_size} {' '.join(worker_args)} "
        f"--tail {args.tail}`. zero3 at ws {args.world_size}; the bench GPT (vocab {args.vocab}, d_model "
        f"{args.d_model}, {args.layers} layers) and an HF Llama from a config (LlamaForCausalLM, hidden "
        f"{args.d_model}, {args.layers} layers, module docstring), AdamW lr {args.lr}, {args.steps} steps, seeds "
        f"0-{args.seeds - 1} (initial weights), learnable data (module docstring: the loss floor is ln {SUCCESSORS} "
        f"= 1.39). Final loss: the mean of the last {args.tail} steps. Gap: (arm - fp32) / fp32 for the same seed; "
        "mean and range over seeds. Losses, not times: the machine's load does not change them.",
        "",
    ]
    for name, model_rows in rows.items():
        lines += table(name, model_rows)
    plot(curves, RESULTS / "loss_curves.png")
    publish(RESULTS, "loss_curves", "\n".join(lines), {"curves": curves, "summary": rows})


def main(argv=None) -> None:
    main_of(parse_args, run_worker, run_launcher, argv)


if __name__ == "__main__":
    main()

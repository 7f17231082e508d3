"""Benchmark: a step of shardwise's sharded pipeline against torch.distributed.pipelining + FSDP2 per stage
(torchtitan's recipe) and against shardwise's whole-copy pipeline, at 4 ranks, same model and data.

    python bench/pipeline/pipe_speed.py                          # the quiet run: 8 rounds of 3 steps per arm
    python bench/pipeline/pipe_speed.py --rounds 2 --steps 1 --out /tmp/pipe_speed   # a smoke run

Without `--worker` the script is the launcher: it starts `--nproc` ranks under torch.distributed.run,
waits, and writes bench/pipeline/results/pipe_speed.{json,md,png}. With `--worker` it is one rank.

Note [arms]: every arm is a 2-stage GPipe pipeline over the 4 ranks with `--micro` micro-batches, the same
GPT (same seed) and the same global batch of the same tokens:
  - "shardwise pipe 2 x zero3 2": `PipeTrainer(PipelineConfig(strategy="zero3"))`, each stage sharded over
    its 2 ranks, keep_gathered (each unit gathered once per step), each unit reduced once per step, the tied
    embedding/head summed across the stages;
  - "torch pipelining + FSDP2": torchtitan's recipe. A `(pp 2, dp 2)` device mesh; each rank's stage module
    is its layers, each `fully_shard`ed over "dp" and then the stage's root, `reshard_after_forward=False`
    (torchtitan's default under pipeline parallelism); torch's `PipelineStage` and `ScheduleGPipe`, which
    drive FSDP2's switches (gradient sync and reshard on the last backward only). The GPT's tied head weight
    is untied, as torchtitan does (each stage its own copy, not summed); AdamW on each rank's DTensor shards;
  - "shardwise whole copy": `PipeTrainer(PipelineConfig(strategy=None))`, 2 stages x 2 replicas, every rank
    holding every layer, its stage's gradients all-reduced over the replicas by the pipeline itself.
Each round runs every arm for `--steps` steps, in an order rotated per round, after a barrier; a step's
time is the slowest rank's. The first round is a warm-up and is dropped. Ratios are paired per round
(the same round's steps, so a burst of load hits both), reported as the median and the range over rounds.
If an arm fails on gloo, its exception is recorded as it was raised and the other arms still run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = {"sharded": "shardwise pipe 2 x zero3 2", "fsdp2": "torch pipelining + FSDP2", "whole": "shardwise whole copy"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8, help="timed rounds (one warm-up round more)")
    p.add_argument("--steps", type=int, default=3, help="steps per arm per round")
    p.add_argument("--micro", type=int, default=4, help="GPipe micro-batches per step")
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {','.join(ARMS)}")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one rank ----------------------------------------------------------------------------


def _gpt(args):
    from shardwise.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                         n_heads=max(1, args.d_model // 64)))


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _tokens(args) -> torch.Tensor:
    # The same on every rank: the pipelines check it, and every arm trains on it.
    return torch.randint(args.vocab, (args.batch * 4, args.seq + 1), generator=torch.Generator().manual_seed(1))


def _shardwise_arm(args, strategy: str | None):
    """Note [arms]: a step of a PipeTrainer over the sampler's batches, cycling."""
    from shardwise.pipeline import PipelineConfig, PipeTrainer, chain_layers, grouped_adamw

    tokens = _tokens(args)
    config = PipelineConfig(num_stages=2, num_microbatches=args.micro, schedule="gpipe", cache=False,
                            strategy=strategy)
    trainer = PipeTrainer(chain_layers(_gpt(args)), _loss, grouped_adamw(lr=(1e-4, 1e-4)), tokens[:, :-1],
                          tokens[:, 1:], global_batch_size=args.batch, config=config)
    batches, epoch = [], 0

    def step():
        nonlocal batches, epoch
        if not batches:
            batches, epoch = list(trainer.sampler.batches(epoch)), epoch + 1
        trainer.step(batches.pop(0))

    return step


def _fsdp2_arm(args):
    """Note [arms]: torchtitan's recipe on this GPT (its chain's layers, cut as the trainer cuts them)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from shardwise.pipeline import chain_layers, param_costs, partition

    mesh = init_device_mesh("cpu", (2, args.nproc // 2), mesh_dim_names=("pp", "dp"))
    stage, dp_rank, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["dp"].size()
    chain = chain_layers(_gpt(args))
    start, end = partition(param_costs(chain), 2)[stage]
    layers = chain.layers[start:end]
    module = torch.nn.Sequential(*layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
    runner = PipelineStage(module, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(runner, args.micro, loss_fn=_loss)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    tokens, per_replica, position = _tokens(args), args.batch // dp, 0

    def step():
        nonlocal position
        rows = torch.arange(position, position + args.batch) % len(tokens)
        mine = tokens[rows[dp_rank * per_replica:(dp_rank + 1) * per_replica]]
        position += args.batch
        if stage == 0:
            schedule.step(mine[:, :-1])
        else:
            schedule.step(target=mine[:, 1:])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    dist.barrier()
    return step


def run_worker(args) -> None:
    import torch.distributed as dist
    from tqdm import tqdm

    import shardwise as sw

    torch.set_num_threads(1)
    sw.init(timeout=600)
    rank = dist.get_rank()
    wanted = [a for a in args.arms.split(",") if a]
    steps, failures = {}, {}
    builders = {"sharded": lambda: _shardwise_arm(args, "zero3"), "fsdp2": lambda: _fsdp2_arm(args),
                "whole": lambda: _shardwise_arm(args, None)}
    for arm in wanted:
        try:
            steps[arm] = builders[arm]()
            steps[arm]()  # the first step: a failure on gloo shows here
        except Exception as error:  # recorded exactly; the other arms still run
            failures[arm] = f"{type(error).__name__}: {error}\n" + "".join(traceback.format_exc().splitlines(True)[-8:])
            steps.pop(arm, None)
    failed = torch.tensor([float(arm in failures) for arm in wanted])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # an arm that failed on any rank is out on every rank
    arms = [arm for arm, out in zip(wanted, failed.tolist()) if not out]
    times = torch.zeros(args.rounds + 1, len(arms), dtype=torch.float64)
    bar = tqdm(total=times.numel(), desc="rounds x arms", unit="arm", disable=rank != 0)
    for round_ in range(args.rounds + 1):
        order = arms[round_ % len(arms):] + arms[:round_ % len(arms)] if arms else []
        for arm in order:
            dist.barrier()
            began = time.perf_counter()
            for _ in range(args.steps):
                steps[arm]()
            times[round_, arms.index(arm)] = (time.perf_counter() - began) / args.steps
            bar.update()
    bar.close()
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failures)
    if rank == 0:
        errors = {arm: text for f in everyone for arm, text in f.items()}
        Path(args.result).write_text(json.dumps({"arms": arms, "times": times[1:].tolist(), "failures": errors}))
    sw.shutdown()


# ---- launcher ----------------------------------------------------------------------------


def summarize(arms: list[str], times: list[list[float]]) -> dict:
    """Per arm, the median step; per pair with the sharded pipeline, the per-round ratios' median and range."""
    per_arm = {arm: [row[i] for row in times] for i, arm in enumerate(arms)}
    out = {"median_step_s": {arm: statistics.median(values) for arm, values in per_arm.items()}, "ratios": {}}
    if "sharded" in per_arm:
        for other in (a for a in arms if a != "sharded"):
            ratios = [s / o for s, o in zip(per_arm["sharded"], per_arm[other])]
            out["ratios"][other] = {"per_round": ratios, "median": statistics.median(ratios),
                                    "min": min(ratios), "max": max(ratios)}
    return out


def markdown(args, result: dict, summary: dict, command: str) -> str:
    lines = [f"Step time at {args.nproc} ranks (gloo, 1 thread each): GPT d_model {args.d_model}, {args.layers} "
             f"blocks, vocab {args.vocab}, seq {args.seq}; global batch {args.batch}, {args.micro} GPipe "
             f"micro-batches; {args.rounds} timed rounds of {args.steps} steps per arm, order rotated per round "
             "(Note [arms] in bench/pipeline/pipe_speed.py).", "", f"Command: `{command}`", "",
             "| arm | median step (s) | sharded / this arm, per round: median [min, max] |", "|---|---:|---:|"]
    for arm in result["arms"]:
        ratio = summary["ratios"].get(arm)
        paired = f"{ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}]" if ratio else "—"
        lines.append(f"| {ARMS[arm]} | {summary['median_step_s'][arm]:.3f} | {paired} |")
    for arm, text in result["failures"].items():
        lines += ["", f"{ARMS[arm]} did not run: ", "```", text.strip(), "```"]
    return "\n".join(lines) + "\n"


def plot(result: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (steps_ax, ratio_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for i, arm in enumerate(result["arms"]):
        values = [row[i] for row in result["times"]]
        steps_ax.plot(range(1, len(values) + 1), values, marker="o", label=ARMS[arm])
    steps_ax.set_xlabel("round")
    steps_ax.set_ylabel("step time (s, slowest rank)")
    steps_ax.legend(fontsize=8)
    for arm, ratio in summary["ratios"].items():
        ratio_ax.plot(range(1, len(ratio["per_round"]) + 1), ratio["per_round"], marker="o",
                      label=f"sharded / {ARMS[arm]}")
    ratio_ax.axhline(1.0, color="gray", lw=0.8)
    ratio_ax.set_xlabel("round")
    ratio_ax.set_ylabel("step time ratio (paired per round)")
    ratio_ax.legend(fontsize=8)
    fig.suptitle("pipe 2 at 4 ranks: shardwise sharded stages against torch pipelining + FSDP2 and the whole copy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_launcher(args) -> None:
    command = "python bench/pipeline/pipe_speed.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, "--worker", "--result", str(result_path), *sys.argv[1:]]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        result = json.loads(result_path.read_text())
    summary = summarize(result["arms"], result["times"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipe_speed.json").write_text(json.dumps({"settings": vars(args), "command": command, **result,
                                                     "summary": summary}, indent=1))
    text = markdown(args, result, summary, command.strip())
    (out / "pipe_speed.md").write_text(text)
    plot(result, summary, out / "pipe_speed.png")
    print(text)


if __name__ == "__main__":
    cli = parse_args()
    run_worker(cli) if cli.worker else run_launcher(cli)

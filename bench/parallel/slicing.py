"""Benchmark: the same GPT on 4 ranks as zero3 (4 x 1), slicing + zero3 (2 x 2) and slicing (1 x 4),
and a wide-MLP variant (d_ff = 16 x d_model), at the same global batch, in one run.

    MALLOC_MMAP_THRESHOLD_=65536 python bench/parallel/slicing.py                      # the full run
    python bench/parallel/slicing.py --d-model 64 --layers 2 --vocab 256 --seq 32 --steps 2 --warmup 1  # a quick look

Without `--worker` the script is the launcher: every (model, layout) runs as 4 fresh ranks under
`torch.distributed.run` (and one single process per model for the loss check), then it writes
bench/parallel/results/slicing.{json,md,png}. With `--worker` it is one rank and writes its numbers.
Every run sets MALLOC_MMAP_THRESHOLD_=65536 so that freed memory leaves the process and peak
RSS shows what a layout holds (DESIGN: glibc keeps freed blocks otherwise); steps are slower
for it, the same for every layout.

Per rank: peak RSS; activation bytes (what autograd saves in one forward, parameters excluded,
by storage); model-state bytes (parameters, gradients, optimizer state, engine buffers, by
storage); median step time; bytes moved in one step, counted by wrapping the collectives and
predicted by Note [traffic model] (shardwise/parallel/slicing/traffic.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LAYOUTS = {"4x1": (4, 1), "2x2": (2, 2), "1x4": (1, 4)}  # data x tensor
MIB = 2**20
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, split over the data axis")
    p.add_argument("--mlp-ratios", default="4,16", help="d_ff / d_model of each model variant")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)  # "reference" or a LAYOUTS key
    p.add_argument("--mlp-ratio", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one rank ----------------------------------------------------------------------


def build_model(args):
    from shardwise.models.gpt import GPT, GPTConfig

    torch.manual_seed(args.seed)
    return GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                         n_heads=args.heads, mlp_ratio=args.mlp_ratio))


def batch(args, step: int):
    gen = torch.Generator().manual_seed(args.seed * 1_000 + step)
    tokens = torch.randint(args.vocab, (args.global_batch, args.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def storages_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes() > 0:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def model_state_bytes(model, optimizer) -> int:
    tensors = [t for p in model.parameters() for t in (p, p.grad)]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for unit in _units_of(model):
        tensors += [unit.full_flat, unit.shard_flat, unit.grads.full]
    return storages_bytes(tensors)


def activation_bytes(model, x, y) -> int:
    """Bytes autograd saves in one forward (by storage), the parameters' own storages excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for unit in _units_of(model):
        params.add(unit.full_flat.untyped_storage().data_ptr())
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def run_worker(args) -> None:
    torch.set_num_threads(1)
    record: dict = {"layout": args.layout, "mlp_ratio": args.mlp_ratio}
    model = build_model(args)
    record["num_params"] = model.num_params()
    if args.layout == "reference":
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        rank, rows, data, tensor_group = 0, slice(None), 1, None
    else:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        import shardwise as sw
        from shardwise.models.gpt import Block

        sw.init()
        data, tensor = LAYOUTS[args.layout]
        mesh = init_device_mesh("cpu", (data, tensor), mesh_dim_names=("data", "tensor"))
        rank = dist.get_rank()
        if tensor > 1:
            sw.slice(model, group=mesh)
        if data > 1:
            sw.shard(model, strategy="zero3", units=Block, process_group=mesh["data"].get_group())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        per = args.global_batch // data
        rows = slice(mesh["data"].get_local_rank() * per, (mesh["data"].get_local_rank() + 1) * per)
        tensor_group = mesh["tensor"].get_group()
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        x, y = (t[rows] for t in batch(args, step))
        start = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    record.update(losses=losses, step_times=times, rank=rank)
    if args.layout != "reference":
        from shardwise.parallel.slicing.traffic import count_collectives, predict_gpt

        x, y = (t[rows] for t in batch(args, 0))
        record["activation_bytes"] = activation_bytes(model, x, y)
        with count_collectives(tensor_group) as counted:
            model(x, y).backward()
            optimizer.step()
        record["model_state_bytes"] = model_state_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        predicted = predict_gpt(args.vocab, args.d_model, args.layers, args.mlp_ratio, args.seq, x.shape[0],
                                data=data, tensor=tensor, tensor_rank=dist.get_rank(tensor_group))
        record["counted_bytes"], record["predicted_bytes"] = counted.total, predicted.total
        record["counted_wire"], record["predicted_wire"] = counted.wire_bytes, predicted.wire_bytes
    record["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    if args.layout != "reference":
        dist.barrier()
        dist.destroy_process_group()


# ---- launcher ----------------------------------------------------------------------


def launch(args, layout: str, mlp_ratio: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    with tempfile.TemporaryDirectory() as out_dir:
        argv = [__file__, "--worker", "--layout", layout, "--mlp-ratio", str(mlp_ratio), "--out-dir", out_dir]
        for flag in ("vocab", "d_model", "layers", "heads", "seq", "global_batch", "steps", "warmup", "seed"):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        cmd = [sys.executable] + argv if layout == "reference" else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"] + argv
        log = Path(out_dir, "output.log")
        with open(log, "w") as sink:
            proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
            try:
                proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return {"error": "timed out", "tail": log.read_text()[-2000:]}
        if proc.returncode != 0:
            return {"error": f"exit status {proc.returncode}", "tail": log.read_text()[-2000:]}
        return {"ranks": sorted((json.loads(p.read_text()) for p in Path(out_dir).glob("rank*.json")),
                                key=lambda r: r["rank"])}


def summarize(args, result: dict, reference: dict) -> dict:
    if "error" in result:
        return result
    ranks = result["ranks"]
    steps = [max(r["step_times"][i] for r in ranks) for i in range(len(ranks[0]["step_times"]))]
    # Each rank's loss is its data rank's (equal-size slices); the mean over all ranks is the global batch's,
    # since every data rank appears once per tensor rank.
    losses = [statistics.fmean(r["losses"][i] for r in ranks) for i in range(len(ranks[0]["losses"]))]
    ref = reference["ranks"][0]["losses"] if "ranks" in reference else None
    worst = max(ranks, key=lambda r: r["peak_rss_bytes"])
    return {"median_step_s": statistics.median(steps[args.warmup:]),
            "peak_rss_mib": worst["peak_rss_bytes"] / MIB,
            "activation_mib": max(r["activation_bytes"] for r in ranks) / MIB,
            "model_state_mib": max(r["model_state_bytes"] for r in ranks) / MIB,
            "counted_mib": max(r["counted_bytes"] for r in ranks) / MIB,
            "predicted_mib": max(r["predicted_bytes"] for r in ranks) / MIB,
            "wire_mib": max(r["counted_wire"] for r in ranks) / MIB,
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref)) if ref else None,
            "num_params": ranks[0]["num_params"]}


def markdown(rows: list[dict], args) -> str:
    lines = [f"GPT vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, {args.heads} heads, seq "
             f"{args.seq}, global batch {args.global_batch}, fp32 AdamW, gloo, 4 ranks of 1 thread, "
             "MALLOC_MMAP_THRESHOLD_=65536. Layout = data x tensor (zero3 over data, slicing over tensor). "
             f"Step time: median of {args.steps} steps after {args.warmup} warm-up, slowest rank. Memory: max "
             "over ranks. Bytes: payload per rank per step (counted = wrapped collectives, predicted = Note "
             "[traffic model]); wire = what a ring moves.", "",
             "| model | layout | step s | peak RSS MiB | activations MiB | model state MiB | counted MiB/step | "
             "predicted MiB/step | wire MiB/step | max loss diff vs 1 process |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        s = row["summary"]
        name = f"d_ff {row['mlp_ratio']}x ({s.get('num_params', 0) / 1e6:.1f}M)" if "error" not in s else \
            f"d_ff {row['mlp_ratio']}x"
        if "error" in s:
            lines.append(f"| {name} | {row['layout']} | failed: {s['error']} |" + " |" * 7)
            continue
        diff = "—" if s["max_loss_diff"] is None else f"{s['max_loss_diff']:.1e}"
        lines.append(f"| {name} | {row['layout']} | {s['median_step_s']:.3f} | {s['peak_rss_mib']:.0f} | "
                     f"{s['activation_mib']:.1f} | {s['model_state_mib']:.1f} | {s['counted_mib']:.2f} | "
                     f"{s['predicted_mib']:.2f} | {s['wire_mib']:.2f} | {diff} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("median_step_s", "step time (s)"), ("peak_rss_mib", "peak RSS per rank (MiB)"),
               ("activation_mib", "activations per rank (MiB)"), ("counted_mib", "bytes moved per rank (MiB)")]
    ratios = sorted({r["mlp_ratio"] for r in rows})
    fig, axes = plt.subplots(len(ratios), len(metrics), figsize=(18, 4 * len(ratios)), squeeze=False)
    for ax_row, ratio in zip(axes, ratios):
        ok = [r for r in rows if r["mlp_ratio"] == ratio and "error" not in r["summary"]]
        for ax, (key, title) in zip(ax_row, metrics):
            ax.bar([r["layout"] for r in ok], [r["summary"][key] for r in ok])
            if key == "counted_mib":
                ax.scatter([r["layout"] for r in ok], [r["summary"]["predicted_mib"] for r in ok], color="black",
                           marker="_", s=400, zorder=3, label="predicted")
                ax.legend()
            ax.set_title(f"d_ff {ratio}x d_model: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_launcher(args) -> None:
    from tqdm import tqdm

    ratios = [int(r) for r in args.mlp_ratios.split(",")]
    layouts = [name for name in args.layouts.split(",") if name]
    runs = [(ratio, layout) for ratio in ratios for layout in ["reference", *layouts]]
    raw, started = {}, time.time()
    for ratio, layout in tqdm(runs, desc="runs", unit="run"):
        tqdm.write(f"d_ff {ratio}x: {layout}")
        raw[(ratio, layout)] = launch(args, layout, ratio)
        if "error" in raw[(ratio, layout)]:
            tqdm.write(f"  FAILED: {raw[(ratio, layout)]['error']}\n{raw[(ratio, layout)]['tail']}")
    rows = [{"mlp_ratio": ratio, "layout": layout, "summary": summarize(args, raw[(ratio, layout)],
                                                                       raw[(ratio, "reference")])}
            for ratio in ratios for layout in layouts]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "layout", "mlp_ratio", "out_dir")}
    meta = {"torch": torch.__version__, "cpus": os.cpu_count(), "wall_s": time.time() - started}
    (out / "slicing.json").write_text(json.dumps({"settings": settings, "meta": meta, "rows": rows,
                                                   "raw": {f"{k[0]}/{k[1]}": v for k, v in raw.items()}}, indent=1))
    table = markdown(rows, args)
    (out / "slicing.md").write_text(table)
    plot(rows, out / "slicing.png")
    print(table)


if __name__ == "__main__":
    cli = parse_args()
    run_worker(cli) if cli.worker else run_launcher(cli)


def _units_of(model) -> tuple:
    """The zero engine's units (none for ddp or an unsharded model)."""
    from shardwise.engine import engine_of

    engine = engine_of(model)
    return engine.units if engine is not None else ()

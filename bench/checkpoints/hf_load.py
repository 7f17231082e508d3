"""Loading Hugging Face pretrained weights into zero3 at N ranks: peak RSS per rank while loading, and time.

    python bench/checkpoints/hf_load.py --rounds 3 --publish                     # 4 ranks, ~760 MiB fp32, all arms
    python bench/checkpoints/hf_load.py --world 2 --hidden 64 --layers 2 --vocab 512 --rounds 1   # checks it runs

Issue 59's done-when 2. A Llama built from a config (nothing downloaded) is written by transformers'
`save_pretrained` in bf16, several files. Each arm is one torchrun of N ranks, one thread each, with
`MALLOC_MMAP_THRESHOLD_=65536` so that freed memory leaves the RSS (DESIGN.md: glibc keeps it otherwise);
each rank samples its RSS every 2 ms while it loads and reports the peak above its RSS before (Python +
torch + transformers), its shards' bytes, and the seconds the load took. The arms run in interleaved rounds
(each round every arm once, the order rotated); the table gives each arm's median over the rounds of the
slowest rank's seconds and of the largest peak, with the range. Arms:

- `shardwise`: `sw.from_pretrained(LlamaForCausalLM, DIR, strategy="zero3")`: each rank reads its rows.
- `from_pretrained+shard`: `LlamaForCausalLM.from_pretrained(DIR, dtype=float32)` on every rank, then
  `sw.shard(model, strategy="zero3")`: every rank holds the whole model first.
- `fsdp2-broadcast`: the model on meta, `fully_shard` per layer, rank 0 loads it whole (`from_pretrained`) and
  `set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)` sends each rank its shards.
- `fsdp2-dcp-hf`: torchtitan's route: the model on meta, `fully_shard` per layer, then
  `torch.distributed.checkpoint.load` of its sharded state dict through DCP's `HuggingFaceStorageReader(DIR)`
  (bf16 converted to the fp32 DTensors). The FSDP2 arms leave the rotary buffers uncomputed (`to_empty`):
  what is measured is the weights' load.

Counts of where the shardwise arm's time goes (no timing): bench/checkpoints/hf_load_counts.py. Not run for timing
on a loaded host (the numbers need quiet cores); the results file records the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ARMS = ("shardwise", "from_pretrained+shard", "fsdp2-broadcast", "fsdp2-dcp-hf")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The largest RSS seen every 2 ms while the block runs, above the RSS before it."""

    def __enter__(self):
        self.before = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def config(args):
    import transformers

    return transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                    num_attention_heads=max(1, args.hidden // 64), intermediate_size=args.hidden * 4)


def write_pretrained(args, tmp: Path) -> tuple[Path, float, int]:
    """The bench's 'pretrained' Llama written by save_pretrained in bf16: (directory, fp32 MiB, files)."""
    import torch
    import transformers

    directory = tmp / "pretrained"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(args)).to(torch.bfloat16)
    fp32_mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    model.save_pretrained(directory, max_shard_size=args.shard_size)
    return directory, fp32_mib, len(list(directory.glob("model*.safetensors")))


def _fsdp2_on_meta(args):
    import torch
    import transformers
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config(args))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model.to_empty(device="cpu")


def load_arm(args, rank: int):
    """The model of arm `args.arm`, loaded from `args.dir` into zero3 (or FSDP2) shards."""
    import torch
    import transformers

    import shardwise as sw

    cls = transformers.LlamaForCausalLM
    if args.arm == "shardwise":
        return sw.from_pretrained(cls, args.dir, strategy="zero3")
    if args.arm == "from_pretrained+shard":
        return sw.shard(cls.from_pretrained(args.dir, dtype=torch.float32), strategy="zero3")
    model = _fsdp2_on_meta(args)
    if args.arm == "fsdp2-broadcast":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = cls.from_pretrained(args.dir, dtype=torch.float32).state_dict() if rank == 0 else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
    else:
        import torch.distributed.checkpoint as dcp

        dcp.load(model.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(args.dir))
    return model


def worker(args) -> None:
    """One rank of one arm: load, measure, write rank 0's gathered JSON to --out."""
    import torch
    import torch.distributed as dist
    import transformers

    import shardwise as sw

    torch.set_num_threads(1)
    sw.init()
    rank = dist.get_rank()
    transformers.LlamaForCausalLM  # noqa: B018 (transformers imports it lazily: not part of the load)
    dist.barrier()
    start = time.perf_counter()
    with PeakRSS() as rss:
        model = load_arm(args, rank)
        dist.barrier()
    seconds = time.perf_counter() - start
    shards = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()) * 4
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"rank": rank, "peak_mib": (rss.peak - rss.before) / 2**20,
                                  "before_mib": rss.before / 2**20, "shards_mib": shards / 2**20, "s": seconds})
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    sw.shutdown()


def run_arm(args, arm: str, directory: Path, out: Path) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world),
               __file__, "--worker", "--arm", arm, "--dir", str(directory), "--out", str(out),
               "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
           "DS_ACCELERATOR": "cpu", "TRANSFORMERS_VERBOSITY": "error"}
    subprocess.run(command, check=True, timeout=3600, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def summarize(runs: list[list[dict]]) -> dict:
    """Median and range over rounds of the slowest rank's seconds and the largest per-rank peak."""
    seconds = [max(r["s"] for r in rows) for rows in runs]
    peaks = [max(r["peak_mib"] for r in rows) for rows in runs]
    return {"s": statistics.median(seconds), "s_range": [min(seconds), max(seconds)],
            "peak_mib": statistics.median(peaks), "peak_range": [min(peaks), max(peaks)],
            "shards_mib": max(r["shards_mib"] for r in runs[0])}


def launcher(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory, fp32_mib, files = write_pretrained(args, Path(tmp))
        table = {"fp32_model_mib": fp32_mib, "files": files, "world": args.world, "rounds": args.rounds,
                 "command": " ".join(["python", "bench/checkpoints/hf_load.py", *sys.argv[1:]]), "runs": {}}
        load = os.getloadavg()[0]
        for round_ in range(args.rounds):
            order = args.arms[round_ % len(args.arms):] + args.arms[:round_ % len(args.arms)]
            for arm in order:
                rows = run_arm(args, arm, directory, Path(tmp) / f"{arm}.json")
                table["runs"].setdefault(arm, []).append(rows)
    table["loadavg"] = [load, os.getloadavg()[0]]
    table["arms"] = {arm: summarize(runs) for arm, runs in table["runs"].items()}
    text = report(table)
    if args.publish:
        results = Path(__file__).resolve().parent / "results"
        results.mkdir(exist_ok=True)
        (results / "hf_load.json").write_text(json.dumps(table, indent=1))
        (results / "hf_load.md").write_text(text)
        plot(table, results / "hf_load.png")
    print(text)


def report(table: dict) -> str:
    lines = [f"# Loading Hugging Face weights into zero3 ({table['world']} ranks)", "",
             f"`{table['command']}`", "",
             f"Llama, {table['fp32_model_mib']:.0f} MiB in fp32, written in bf16 as {table['files']} files; "
             f"{table['rounds']} interleaved rounds; load average {table['loadavg'][0]:.1f} before, "
             f"{table['loadavg'][1]:.1f} after. Peak RSS per rank while loading, above its RSS before (MiB; "
             "MALLOC_MMAP_THRESHOLD_=65536; the largest rank's), against its fp32 shards; seconds of the slowest "
             "rank. Median over rounds [range].", "",
             "| arm | peak per rank (MiB) | shards per rank (MiB) | seconds |", "|---|---|---|---|"]
    for arm, s in table["arms"].items():
        lines.append(f"| {arm} | {s['peak_mib']:.1f} [{s['peak_range'][0]:.1f}, {s['peak_range'][1]:.1f}] | "
                     f"{s['shards_mib']:.1f} | {s['s']:.2f} [{s['s_range'][0]:.2f}, {s['s_range'][1]:.2f}] |")
    return "\n".join(lines) + "\n"


def plot(table: dict, path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.common.plot import panels, save

    fig, ((memory, seconds),) = panels()
    arms = list(table["arms"])
    for axis, key, label in ((memory, "peak_mib", "peak RSS per rank while loading (MiB)"),
                             (seconds, "s", "seconds (slowest rank)")):
        values = [table["arms"][a][key] for a in arms]
        ranges = [table["arms"][a][key.replace("_mib", "") + "_range"] for a in arms]
        errors = [[v - r[0] for v, r in zip(values, ranges)], [r[1] - v for v, r in zip(values, ranges)]]
        axis.bar(arms, values, yerr=errors, capsize=4)
        axis.set_ylabel(label)
        axis.tick_params(axis="x", labelrotation=20)
    memory.axhline(table["arms"][arms[0]]["shards_mib"], color="gray", linestyle="--", label="fp32 shards per rank")
    memory.legend()
    save(fig, path, f"A Hugging Face directory into zero3, {table['world']} ranks, "
                    f"{table['fp32_model_mib']:.0f} MiB fp32 (median, range over {table['rounds']} rounds)")


def model_parser(description: str, world: int, arms: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options of the model and its files, the arms, and the worker's own (hidden), for this bench and
    hf_load_counts.py."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=world)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-size", default="100MB", help="save_pretrained's max_shard_size")
    parser.add_argument("--arms", nargs="+", default=list(arms), choices=arms)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def parse_args(argv=None):
    parser = model_parser(__doc__, 4, ARMS)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each arm once per round)")
    parser.add_argument("--publish", action="store_true",
                        help="write hf_load.md, .json and .png under bench/checkpoints/results/")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parsed = parse_args()
    worker(parsed) if parsed.worker else launcher(parsed)

"""Loading Hugging Face pretrained weights into zero3 at N ranks: peak RSS per rank while loading, and time.

    python bench/checkpoints/hf_load.py                                    # 4 ranks, a Llama of ~0.5 GB fp32, all arms
    python bench/checkpoints/hf_load.py --world 2 --hidden 64 --layers 2   # the smallest: checks that it runs

Issue 59's done-when 2. A Llama built from a config (nothing downloaded) is written by transformers'
`save_pretrained` in bf16, several files. Each arm is one torchrun of N ranks, one thread each, with
`MALLOC_MMAP_THRESHOLD_=65536` so that freed memory leaves the RSS (DESIGN.md: glibc keeps it otherwise);
each rank samples its RSS every 2 ms while it loads and reports the peak above its RSS before (Python +
torch + transformers), its shards' bytes, and the seconds the load took. Arms:

- `shardwise`: `sw.from_pretrained(LlamaForCausalLM, DIR, strategy="zero3")`: each rank reads its rows.
- `from_pretrained+shard`: `LlamaForCausalLM.from_pretrained(DIR, dtype=float32)` on every rank, then
  `sw.shard(model, strategy="zero3")`: every rank holds the whole model first.
- `fsdp2-broadcast`: FSDP2's route: the model on meta, `fully_shard` per layer, rank 0 loads it whole
  (`from_pretrained`) and `set_model_state_dict(..., broadcast_from_rank0=True)` sends each rank its shards.

Not run for timing on a loaded host (the numbers need quiet cores); the report says the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ARMS = ("shardwise", "from_pretrained+shard", "fsdp2-broadcast")


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


def worker(args) -> None:
    """One rank of one arm: load, measure, write rank 0's gathered JSON to --out."""
    import torch
    import torch.distributed as dist
    import transformers

    import shardwise as sw

    torch.set_num_threads(1)
    sw.init()
    rank = dist.get_rank()
    cls = transformers.LlamaForCausalLM
    dist.barrier()
    start = time.perf_counter()
    with PeakRSS() as rss:
        if args.arm == "shardwise":
            model = sw.from_pretrained(cls, args.dir, strategy="zero3")
        elif args.arm == "from_pretrained+shard":
            model = sw.shard(cls.from_pretrained(args.dir, dtype=torch.float32), strategy="zero3")
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
            from torch.distributed.fsdp import fully_shard

            with torch.device("meta"):
                model = cls(config(args))
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            model.to_empty(device="cpu")
            full = cls.from_pretrained(args.dir, dtype=torch.float32).state_dict() if rank == 0 else {}
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                       broadcast_from_rank0=True))
            del full
        dist.barrier()
    seconds = time.perf_counter() - start
    shards = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()) * 4
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"rank": rank, "peak_mib": (rss.peak - rss.before) / 2**20,
                                  "before_mib": rss.before / 2**20, "shards_mib": shards / 2**20, "s": seconds})
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    sw.shutdown()


def launcher(args) -> None:
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "pretrained"
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config(args)).to(torch.bfloat16)
        fp32_mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
        model.save_pretrained(directory, max_shard_size=args.shard_size)
        del model
        files = len(list(directory.glob("model*.safetensors")))
        table = {"fp32_model_mib": fp32_mib, "files": files, "world": args.world, "arms": {}}
        load = os.getloadavg()[0]
        for arm in args.arms:
            out = Path(tmp) / f"{arm}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(args.world), __file__, "--worker", "--arm", arm, "--dir", str(directory), "--out", str(out),
                       "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
                   "DS_ACCELERATOR": "cpu", "TRANSFORMERS_VERBOSITY": "error"}
            subprocess.run(command, check=True, timeout=3600, env=env, stdout=subprocess.DEVNULL)
            table["arms"][arm] = json.loads(out.read_text())
    table["loadavg"] = [load, os.getloadavg()[0]]
    lines = [f"# Loading Hugging Face weights into zero3 ({args.world} ranks)", "",
             f"Llama, {table['fp32_model_mib']:.0f} MiB in fp32, written in bf16 as {files} files; load average "
             f"{load:.1f} before, {table['loadavg'][1]:.1f} after. Peak RSS per rank while loading, above its RSS "
             "before (MiB; MALLOC_MMAP_THRESHOLD_=65536), against its fp32 shards.", "",
             "| arm | max peak per rank | shards per rank | seconds (slowest rank) |", "|---|---|---|---|"]
    for arm, rows in table["arms"].items():
        lines.append(f"| {arm} | {max(r['peak_mib'] for r in rows):.1f} | {max(r['shards_mib'] for r in rows):.1f} "
                     f"| {max(r['s'] for r in rows):.2f} |")
    text = "\n".join(lines) + "\n"
    if args.publish:
        results = Path(__file__).resolve().parent / "results"
        results.mkdir(exist_ok=True)
        (results / "hf_load.json").write_text(json.dumps(table, indent=1))
        (results / "hf_load.md").write_text(text)
    print(text)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-size", default="100MB", help="save_pretrained's max_shard_size")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--publish", action="store_true", help="write bench/checkpoints/results/hf_load.{md,json}")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    parsed = parse_args()
    worker(parsed) if parsed.worker else launcher(parsed)

"""How long `sw.load` takes and how many bytes it reads, here and in another source tree.

    python bench/checkpoints/load_time.py                                   # this tree: the zoo GPT, 5 rounds
    python bench/checkpoints/load_time.py --old-src /tmp/old22/src          # interleaved with an older tree
    python bench/checkpoints/load_time.py --old-src /tmp/old22/src --model big --loads 3 --rounds 3

`git worktree add /tmp/old22 c6ffb25` gives the tree before issue 22's validate-then-apply load
(Note [validate, then apply] in checkpoint/read/load.py). Each round runs one process per tree, this
tree second; each process saves a checkpoint in its own format (once per tree: the formats
differ), loads it once to warm the page cache, then times `--loads` loads of the model with its
AdamW state (one process, world size 1) and counts the bytes its `os.pread`/`os.preadv` calls
return during one load. The result per tree: the median of the rounds' medians and the range of
those medians, the bytes read per load against the rank files' size, and the load average before
and after (a loaded machine spreads the times; say so with the figures).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("zoo", "big")


def build(name: str):
    """The model and an AdamW that has stepped once (so it has state to load)."""
    import torch

    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.models.zoo import build as build_zoo

    if name == "zoo":
        model = build_zoo("gpt")
    else:  # 29M parameters: about 340 MiB of rank files with AdamW's two moments
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=8192, seq_len=16, d_model=512, n_layers=8, n_heads=8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optim.step()
    optim.zero_grad()
    return model, optim


def child(args) -> None:
    """One process: save if needed, then time loads and count one load's bytes; prints one JSON line."""
    logging.disable(logging.WARNING)  # the one-process notice of sw.init
    import torch

    import shardwise as sw

    torch.set_num_threads(1)
    model, optim = build(args.model)
    if not os.path.exists(args.ckpt):
        sw.save(args.ckpt, model, optim)
    sw.load(args.ckpt, model, optim)  # the page cache holds the files from here on
    times = []
    for _ in range(args.loads):
        start = time.perf_counter()
        sw.load(args.ckpt, model, optim)
        times.append(time.perf_counter() - start)
    read = [0]
    pread, preadv = os.pread, os.preadv

    def counted_pread(fd, length, offset):
        data = pread(fd, length, offset)
        read[0] += len(data)
        return data

    def counted_preadv(fd, buffers, offset):
        count = preadv(fd, buffers, offset)
        read[0] += count
        return count

    os.pread, os.preadv = counted_pread, counted_preadv
    sw.load(args.ckpt, model, optim)
    os.pread, os.preadv = pread, preadv
    files = sum(p.stat().st_size for p in Path(args.ckpt).glob("*.safetensors"))
    print(json.dumps({"median_ms": statistics.median(times) * 1e3, "bytes_read": read[0], "file_bytes": files}))


def run_tree(src: str, ckpt: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    argv = [sys.executable, __file__, "--child", "--ckpt", str(ckpt), "--model", args.model, "--loads",
            str(args.loads)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-src", default=None, help="another tree's src/ to time beside this one")
    parser.add_argument("--model", choices=MODELS, default="zoo", help="zoo: the zoo GPT; big: a 29M GPT")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loads", type=int, default=30, help="timed loads per process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    trees = {"old": args.old_src} if args.old_src else {}
    trees["this"] = str(Path(__file__).resolve().parents[2] / "src")
    load_before = os.getloadavg()
    results: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, src in trees.items():
                result = run_tree(src, Path(tmp) / name, args)
                results[name].append(result)
                print(f"round {round_ + 1} {name:4}: {result['median_ms']:8.2f} ms", flush=True)
    load_after = os.getloadavg()
    for name, rounds in results.items():
        medians = [r["median_ms"] for r in rounds]
        print(f"{name:4} {trees[name]}: median {statistics.median(medians):.2f} ms, range "
              f"[{min(medians):.2f}, {max(medians):.2f}] over {len(medians)} rounds of {args.loads} loads; "
              f"reads {rounds[-1]['bytes_read']} bytes per load of {rounds[-1]['file_bytes']} in its rank files")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} "
          f"{load_after[1]:.2f} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()

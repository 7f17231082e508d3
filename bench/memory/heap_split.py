"""Where a block's RSS goes besides its elements (Note [per-tensor objects], estimate/objects.py): glibc's mallinfo2 on
each rank of max_model.py's zero3 GPT at two depths, phase by phase, per block of the difference.

    python bench/memory/heap_split.py                          # d_model 512, 20 and 60 blocks, 4 ranks, 3 steps
    python bench/memory/heap_split.py --d-model 256 --steps 3  # a width whose activations land in malloc's heap

Per phase (built, then each step's forward, backward, optimizer step, zero_grad), rank 0's growth per block from
the shallow to the deep model in MiB: RSS, malloc's heap (arena; of it in use and free) and mapped blocks (every
allocation of 64 KiB or more under MALLOC_MMAP_THRESHOLD_=65536, as the bench runs), and what RSS holds outside
malloc (pymalloc's arenas: Python objects). Printed, not written: bench/memory/results/estimate_gap.md quotes it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
from bench.common.launch import rss_bytes  # noqa: E402

MIB = 2**20
FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]


def snapshot(tag: str) -> dict:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    rss = rss_bytes("VmRSS")
    return {"tag": tag, "rss": rss, "heap": info.arena, "heap in use": info.uordblks, "heap free": info.fordblks,
            "mapped": info.hblkhd, "outside malloc": rss - info.arena - info.hblkhd}


def run_worker(args) -> None:
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.models.gpt import GPT, Block, GPTConfig

    torch.set_num_threads(1)
    sw.init()
    cfg = GPTConfig(vocab_size=8192, seq_len=32, d_model=args.d_model, n_layers=args.layers,
                    n_heads=max(1, args.d_model // 64))
    torch.manual_seed(0)
    with sw.deferred_init():
        model = GPT(cfg)
    sw.shard(model, strategy="zero3", units=Block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    phases = [snapshot("built")]
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    for step in range(args.steps):
        tokens = torch.randint(cfg.vocab_size, (1, cfg.seq_len + 1), generator=gen)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        phases.append(snapshot(f"forward {step}"))
        loss.backward()
        phases.append(snapshot(f"backward {step}"))
        optimizer.step()
        phases.append(snapshot(f"step {step}"))
        optimizer.zero_grad(set_to_none=True)
        phases.append(snapshot(f"zero_grad {step}"))
    dist.barrier()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(phases))
    dist.destroy_process_group()


def run_launcher(args) -> None:
    runs = {}
    for layers in args.depths:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp, "rank0.json")
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={args.world_size}", __file__, "--worker", "--layers", str(layers),
                            "--d-model", str(args.d_model), "--steps", str(args.steps), "--out", str(out)],
                           check=True, timeout=1800, stdout=subprocess.DEVNULL,
                           env=dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536"))
            runs[layers] = json.loads(out.read_text())
    (low, shallow), (high, deep) = sorted(runs.items())
    keys = [k for k in shallow[0] if k != "tag"]
    print(f"d_model {args.d_model}, rank 0, MiB per block from {low} to {high} blocks "
          f"(a block's elements: {(12 * args.d_model**2 + 10 * args.d_model) / args.world_size * 4 / MIB:.3f} MiB "
          "per fp32 state)")
    print(f"| phase | {' | '.join(keys)} |\n|---|{'---:|' * len(keys)}")
    for a, b in zip(shallow, deep):
        print(f"| {a['tag']} | " + " | ".join(f"{(b[k] - a[k]) / (high - low) / MIB:.3f}" for k in keys) + " |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--depths", type=int, nargs=2, default=[20, 60])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    run_worker(args) if args.worker else run_launcher(args)


if __name__ == "__main__":
    main()

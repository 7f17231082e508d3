"""How far clipped training drifts from one process: shardwise's `sw.clip_grad_norm_` under
zero2/zero3 beside torch DDP + `torch.nn.utils.clip_grad_norm_` (issue 20, Note [clip arithmetic]).

    python bench/correctness/clip_parity.py          # OPT (ReLU) from a config, 5 clipped AdamW steps, 2 ranks

Each arm trains the same model from the same seed on the same global batch, each rank its half;
the single process trains on the whole batch. Reported: the largest parameter difference from the
single process after the last step. Writes bench/correctness/results/clip_parity.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS, BATCH, SEQ, MAX_NORM = 5, 8, 32, 0.05
ROOT = Path(__file__).resolve().parents[2]


def build():
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4,
                       max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0,
                       activation_function="relu")
    return OPTForCausalLM(config)


def batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def train(model, rank, world_size, clip):
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_rank = BATCH // world_size
    for ids in batches():
        ids = ids[rank * per_rank:(rank + 1) * per_rank]
        model(input_ids=ids, labels=ids).loss.backward()
        clip(model)
        optim.step()
        optim.zero_grad()


def single() -> dict[str, torch.Tensor]:
    model = build()
    train(model, 0, 1, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def worker(rank: int, arm: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import shardwise as sw
    sw.init()
    model = build()
    if arm == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        train(ddp, rank, 2, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM))
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        sw.shard(model, strategy=arm)
        train(model, rank, 2, lambda m: sw.clip_grad_norm_(m, MAX_NORM))
        params = sw.full_parameters(model)
    if rank == 0:
        torch.save(params, out)
    dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    reference = single()
    rows = []
    for arm in ["ddp", "zero2", "zero3"]:
        out = f"/tmp/clip_parity_{arm}.pt"
        mp.spawn(worker, args=(arm, out), nprocs=2)
        params = torch.load(out)
        drift = max((params[n] - reference[n]).abs().max().item() for n in reference)
        rows.append(f"| {arm} | {drift:.2e} |")
        print(rows[-1], flush=True)
    table = ("| arm (2 ranks) | max abs parameter difference from one process after 5 clipped AdamW steps |\n"
             "|---|---|\n" + "\n".join(rows) + "\n")
    (Path(__file__).resolve().parent / "results" / "clip_parity.md").write_text(
        f"OPT from a config (ReLU, 2 layers, d 64), clip at {MAX_NORM}, lr 1e-3, global batch {BATCH} x {SEQ}.\n"
        f"Command: `python bench/correctness/clip_parity.py`.\n\n" + table)


if __name__ == "__main__":
    sys.exit(main())

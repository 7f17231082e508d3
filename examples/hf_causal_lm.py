"""Fine-tune a Hugging Face causal LM under torchrun with zero3, and resume from the newest checkpoint.

    torchrun --standalone --nproc-per-node 2 examples/hf_causal_lm.py --max-steps 200
    python examples/hf_causal_lm.py --max-steps 20          # one process: the same script

The model is GPT-2 built from a small config (`AutoModelForCausalLM.from_config`: nothing is
downloaded) over a byte-level vocabulary of 256, so no tokenizer is needed either. The text is
the Python standard library's own source, cut into fixed windows. Every `--save-every` steps
the script saves a checkpoint into `--out`; started again with the same `--out`, it resumes
from the newest one (model, optimizer, data position and RNG states), so a run killed at any
point continues as if it had never stopped. Rank 0 prints `step N loss X` (the mean over ranks).
At the end `sw.save_pretrained` writes `OUT/hf/` (model.safetensors + config.json), which
`AutoModelForCausalLM.from_pretrained` loads without shardwise.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM

import shardwise as sw


class ByteWindows(Dataset):
    """Non-overlapping windows of `seq` bytes of the standard library's .py files (same bytes everywhere)."""

    def __init__(self, seq: int, max_bytes: int = 1_000_000):
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        data = b"".join(path.read_bytes() for path in sorted(stdlib.glob("*.py"))[:200])[:max_bytes]
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq = seq

    def __len__(self) -> int:
        return len(self.tokens) // self.seq

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index * self.seq : (index + 1) * self.seq]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-steps", type=int, default=200, help="optimizer steps in all (default: 200)")
    parser.add_argument("--strategy", default="zero3", choices=sw.STRATEGIES, help="default: zero3")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default: 8)")
    parser.add_argument("--seq", type=int, default=128, help="bytes per sequence (default: 128)")
    parser.add_argument("--layers", type=int, default=4, help="GPT-2 blocks (default: 4)")
    parser.add_argument("--width", type=int, default=128, help="n_embd (default: 128)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument("--out", default="out/hf_causal_lm", help="checkpoint directory (default: out/hf_causal_lm)")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (default: 50)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)                                  # one thread per rank (CPU)
    sw.init()                                                 # torchrun's environment, or one process
    rank = sw.get_rank()

    config = AutoConfig.for_model("gpt2", vocab_size=256, n_positions=args.seq, n_embd=args.width,
                                  n_layer=args.layers, n_head=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)                                      # every rank builds the same model
    with sw.deferred_init():                                  # nothing allocated until shard()
        model = AutoModelForCausalLM.from_config(config)
    model.loss_type = "ForCausalLM"                           # GPT2LMHeadModel's name names no loss: else a warning
    sw.shard(model, strategy=args.strategy)                   # units="auto": GPT-2's GPT2Block layers
    if rank == 0:
        print(sw.describe(model))
    fit(model, args)
    sw.save_pretrained(model, Path(args.out) / "hf")          # model.safetensors + config.json
    if rank == 0:
        print(f"from_pretrained reads {Path(args.out) / 'hf'}")
    sw.shutdown()


def fit(model, args) -> None:
    """AdamW over the sharded model to `args.max_steps`, resumed from the newest checkpoint in `args.out`
    when there is one, a checkpoint every `args.save_every` steps (examples/hf_finetune_pretrained.py
    runs the same loop on a pretrained model)."""
    rank = sw.get_rank()
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    data = ByteWindows(args.seq)
    sampler = sw.ResumableSampler(data, seed=0)               # each rank its share; its position is saved
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, generator=torch.Generator())

    step = 0
    checkpoint = sw.latest(args.out)
    if checkpoint is not None:                                # resume: any world size, any strategy
        report = sw.load(checkpoint, model, optim, sampler=sampler)
        step = report.extra["step"]
        if rank == 0:
            print(f"resumed from {checkpoint} at step {step}")

    model.train()
    while step < args.max_steps:
        for ids in loader:
            loss = model(input_ids=ids, labels=ids).loss      # HF shifts the labels itself
            loss.backward()
            sw.clip_grad_norm_(model, 1.0)                    # the global norm over every rank's shard
            optim.step()
            optim.zero_grad()
            step += 1
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)       # for the log only
            if rank == 0:
                print(f"step {step} loss {mean.item():.4f}", flush=True)
            if not math.isfinite(mean.item()):
                raise SystemExit(f"loss is {mean.item()} at step {step}")
            if step % args.save_every == 0 or step == args.max_steps:
                sw.save(Path(args.out) / f"step-{step:06d}", model, optim, sampler=sampler, step=step,
                        keep_last=2)
            if step == args.max_steps:
                break


if __name__ == "__main__":
    main()

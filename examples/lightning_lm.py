"""A Lightning script on a zero3-sharded GPT-2: `L.Trainer(strategy=ShardwiseStrategy("zero3"), ...)`.

    torchrun --standalone --nproc-per-node 2 examples/lightning_lm.py --max-steps 100
    python examples/lightning_lm.py --max-steps 10            # one process: the same script

The LightningModule holds the model and only the math; `ShardwiseStrategy` (instead of
`strategy="ddp"` or `"fsdp"`) shards it with `sw.shard` where DDP would wrap it. Clipping
(`gradient_clip_val`) is the global norm, gradient accumulation (`accumulate_grad_batches`)
skips the reduce on all but the last micro-batch, and `ModelCheckpoint` writes shardwise
checkpoint directories (every rank its rows and optimizer rows, with Lightning's own state as
JSON in index.json) into OUT/checkpoints every `--save-every` steps. Started again with the same
`--out`, the script resumes from the newest one (`fit(ckpt_path=...)`: model, optimizer rows,
RNG states, Lightning's loops, and the data position: torchdata's `StatefulDataLoader` is one
Lightning saves and restores) and ends bitwise equal to an uninterrupted run. Two choices in the
loader make that so. The script deals the data out itself (`StatefulDistributedSampler`, its
order fixed by seed and epoch): given `shuffle=True`, Lightning would wrap the loader's own
random sampler in its `DistributedSamplerWrapper`, which hides that sampler's generator state
from the checkpoint, and each `iter()` the resume makes draws a new order from the advancing
generator. And the loader has its own generator: a loader without one draws its iterator's seed
from the global RNG, which on resume happens after the RNG was restored, so dropout's draws shift.
Lightning's start-up notes and tips are turned off at their loggers; rank 0 prints the steps. GPT-2
is built from a small config over a byte-level vocabulary of 256: nothing is downloaded.
`shardwise ckpt export DIR OUT.safetensors` turns a checkpoint into one plain safetensors file
(under the LightningModule's names: `model.transformer.h.0...`).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sysconfig
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM

import shardwise as sw
from shardwise.integrations.lightning import ShardwiseStrategy


def byte_windows(seq: int, max_bytes: int = 1_000_000) -> torch.Tensor:
    """The standard library's .py files as non-overlapping windows of `seq` bytes, one per row."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(path.read_bytes() for path in sorted(stdlib.glob("*.py"))[:200])[:max_bytes]
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return tokens[: len(tokens) // seq * seq].view(-1, seq)


class LitLM(L.LightningModule):
    """GPT-2 from a config, trained as a causal LM; nothing in it knows about shardwise."""

    def __init__(self, seq: int, lr: float):
        super().__init__()
        config = AutoConfig.for_model("gpt2", vocab_size=256, n_positions=seq, n_embd=128, n_layer=4, n_head=4,
                                      bos_token_id=0, eos_token_id=0)
        self.model = AutoModelForCausalLM.from_config(config)
        self.model.loss_type = "ForCausalLM"                  # GPT2LMHeadModel's name names no loss: else a warning
        self.lr = lr
        self.micro_losses = []

    def training_step(self, ids, batch_idx):
        loss = self.model(input_ids=ids, labels=ids).loss
        self.micro_losses.append(loss.detach())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if len(self.micro_losses) < self.trainer.accumulate_grad_batches:
            return                                            # the optimizer has not stepped yet
        mean = self.trainer.strategy.reduce(torch.stack(self.micro_losses).mean(), reduce_op="mean")  # log only
        self.micro_losses = []
        if self.trainer.is_global_zero:
            print(f"step {self.trainer.global_step} loss {mean.item():.4f}", flush=True)
        if not math.isfinite(mean.item()):
            raise SystemExit(f"loss is {mean.item()} at step {self.trainer.global_step}")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)  # built after sharding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps in all (default: 100)")
    parser.add_argument("--strategy", default="zero3", choices=sw.STRATEGIES[1:], help="default: zero3")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch (default: 4)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step (default: 2)")
    parser.add_argument("--seq", type=int, default=128, help="bytes per sequence (default: 128)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (default: 50)")
    parser.add_argument("--out", default="out/lightning_lm", help="output directory (default: out/lightning_lm)")
    args = parser.parse_args()
    torch.set_num_threads(1)                                  # one thread per rank (CPU)
    for name in ("lightning.pytorch", "lightning.fabric"):    # GPU/TPU lines, tips, the distributed banner
        logging.getLogger(name).setLevel(logging.WARNING)
    # torchdata 0.11's StatefulDataLoader calls torch._C.set_vital, which torch 2.13 deprecates: nothing this
    # script can change (lightning's LeafSpec deprecation is dropped by shardwise's integration, Note [pinned pair]).
    warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
    # Started again, the script resumes into its own checkpoint directory on purpose.
    warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")

    torch.manual_seed(0)                                      # every rank builds the same model
    module = LitLM(args.seq, args.lr)
    # Each rank's share in an order fixed by (seed, epoch) alone, resumed at the sample it stopped at
    # (Lightning saves the loader's position in each checkpoint); the loader's own generator keeps the
    # iterator's seed draw off the global RNG that dropout uses (both: see the docstring).
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    data = byte_windows(args.seq)
    sampler = StatefulDistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = StatefulDataLoader(data, batch_size=args.batch, sampler=sampler, generator=torch.Generator())
    checkpoints = Path(args.out) / "checkpoints"
    trainer = L.Trainer(
        strategy=ShardwiseStrategy(args.strategy),            # instead of "ddp" / "fsdp": units=, precision= too
        accelerator="cpu", devices=world,
        max_steps=args.max_steps, gradient_clip_val=1.0, accumulate_grad_batches=args.accumulate,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=args.save_every, save_top_k=-1)],
        logger=False, enable_progress_bar=False, enable_model_summary=False)
    resume = sw.latest(checkpoints)                           # a shardwise checkpoint directory, or None
    if resume is not None and trainer.is_global_zero:
        print(f"resuming from {resume}")
    trainer.fit(module, loader, ckpt_path=resume)


if __name__ == "__main__":
    main()

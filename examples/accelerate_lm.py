"""An Accelerate training loop on a zero3-sharded GPT-2: `ShardwiseAccelerator` instead of `Accelerator`.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_lm.py --max-steps 100
    python examples/accelerate_lm.py --max-steps 10           # one process: the same script

The lines marked `# shardwise` (and `import shardwise as sw`) are the whole change from the
loop Accelerate's docs write (`prepare`, `accumulate`, `backward`, `clip_grad_norm_`,
`save_model`): `sw.init()`, `sw.shard(model, ...)` before Accelerate sees the model,
`ShardwiseAccelerator` instead of `Accelerator`, and `sw.save` for checkpoints, for its
`step=` and `keep_last=` (`accelerator.save_state(dir)` works too: it writes the same shardwise
checkpoint, every rank its rows, and `load_state(dir)` reads it back). Mixed precision is
`sw.shard(..., precision="bf16")` (`--precision`);
`ShardwiseAccelerator(mixed_precision="bf16")` would autocast instead, as the plain Accelerator
does (`"fp16"` is refused: use precision="fp16"). GPT-2 is built from a small config over a
byte-level vocabulary of 256: nothing is downloaded. Every `--save-every` optimizer steps, and at
the end, `sw.save` writes OUT/step-N (model and optimizer, every rank its rows and RNG states);
started again with the same `--out`, the script resumes from the newest one: the data order
depends only on (seed, epoch) (`use_seedable_sampler`), and `skip_first_batches` skips what the
saved steps consumed, so a resumed run ends bitwise equal to an uninterrupted one at the same
world size. `accelerator.save_model` writes OUT/final/model.safetensors from rank 0.
"""

from __future__ import annotations

import argparse
import logging
import math
import sysconfig
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM

import shardwise as sw
from shardwise.integrations.accelerate import ShardwiseAccelerator  # shardwise


def byte_windows(seq: int, max_bytes: int = 1_000_000) -> torch.Tensor:
    """The standard library's .py files as non-overlapping windows of `seq` bytes, one per row."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(path.read_bytes() for path in sorted(stdlib.glob("*.py"))[:200])[:max_bytes]
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return tokens[: len(tokens) // seq * seq].view(-1, seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps (default: 100)")
    parser.add_argument("--strategy", default="zero3", choices=sw.STRATEGIES[1:], help="default: zero3")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="default: fp32")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch (default: 4)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step (default: 2)")
    parser.add_argument("--seq", type=int, default=128, help="bytes per sequence (default: 128)")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (default: 50)")
    parser.add_argument("--out", default="out/accelerate_lm", help="output directory (default: out/accelerate_lm)")
    args = parser.parse_args()
    torch.set_num_threads(1)                                  # one thread per rank (CPU)

    sw.init()                                                                   # shardwise
    config = AutoConfig.for_model("gpt2", vocab_size=256, n_positions=args.seq, n_embd=128, n_layer=4,
                                  n_head=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)                                      # every rank builds the same model
    model = AutoModelForCausalLM.from_config(config)
    model.loss_type = "ForCausalLM"                           # GPT2LMHeadModel's name names no loss: else a warning
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)  # before shard(): works too
    sw.shard(model, strategy=args.strategy, precision=args.precision)          # shardwise
    loader = DataLoader(byte_windows(args.seq), batch_size=args.batch, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    # save_model stores the tied head once (as from_pretrained expects) and warns that it did: expected here.
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)

    # On CPU, Accelerate sees torchrun's ranks only with cpu=True; without it each rank would think it
    # runs alone and prepare() would hand every rank the same batches.
    accelerator = ShardwiseAccelerator(gradient_accumulation_steps=args.accumulate,           # shardwise
                                       cpu=not torch.cuda.is_available(),
                                       dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    if accelerator.num_processes != sw.get_world_size():
        raise SystemExit(f"Accelerate sees {accelerator.num_processes} processes, torchrun started "
                         f"{sw.get_world_size()}")
    model, optim, loader = accelerator.prepare(model, optim, loader)  # the model stays as sw.shard left it

    step, micro_losses = 0, []
    if (checkpoint := sw.latest(args.out)) is not None:      # resume: model, optimizer rows, RNG states
        step = sw.load(checkpoint, model, optim).extra["step"]
        accelerator.print(f"resumed from {checkpoint} at step {step}")
    steps_per_epoch = math.ceil(len(loader) / args.accumulate)  # a short last step ends each epoch

    model.train()
    while step < args.max_steps:
        epoch, done = divmod(step, steps_per_epoch)
        loader.set_epoch(epoch)                               # the order depends on (seed, epoch) only
        for ids in accelerator.skip_first_batches(loader, done * args.accumulate) if done else loader:
            with accelerator.accumulate(model):               # no reduce on all but the last micro-batch
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                micro_losses.append(loss.detach())
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the global norm (sw.clip_grad_norm_)
                optim.step()                                  # Accelerate steps only when gradients synced
                optim.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            mean = accelerator.reduce(torch.stack(micro_losses).mean(), "mean")  # for the log only
            micro_losses = []
            accelerator.print(f"step {step} loss {mean.item():.4f}")
            if not math.isfinite(mean.item()):
                raise SystemExit(f"loss is {mean.item()} at step {step}")
            if step % args.save_every == 0 or step == args.max_steps:  # or accelerator.save_state(dir): the same
                sw.save(Path(args.out) / f"step-{step:06d}", model, optim, step=step, keep_last=2)  # shardwise
            if step == args.max_steps:
                break
    accelerator.save_model(model, Path(args.out) / "final")  # the whole model, written by rank 0
    accelerator.end_training()                                # also leaves the process group (sw.shutdown())


if __name__ == "__main__":
    main()

"""transformers' `Trainer` on a zero3-sharded model: an ordinary Trainer script, three calls changed.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --max-steps 100
    python examples/hf_trainer.py --max-steps 10             # one process: the same script

The lines marked `# shardwise` (and `import shardwise as sw`) are the whole change from a plain
Trainer script: `sw.init()`, `sw.shard(model, ...)` before the trainer sees the model, and
`ShardwiseTrainer` instead of `Trainer` (it keeps Accelerate from wrapping the sharded model in
DDP, clips and logs the global gradient norm, and skips the reduce on all but the last
accumulation micro-batch). Data loading, the optimizer, the scheduler and logging stay the
Trainer's own, and so are its checkpoints: every `--save-every` steps it writes OUT/checkpoint-N
(the whole model, written by rank 0, and in `checkpoint-N/shardwise/` every rank's optimizer
rows); started again with the same `--out`, the script continues from the newest one
(`resume_from_checkpoint`; any world size), bitwise equal to an uninterrupted run at the same
world size. The schedule is constant: one that decays over `max_steps` would, resumed with a
larger `--max-steps`, go on from the saved optimizer's learning rate of the shorter run (0 at
its end). Rank 0 prints `step N loss X grad_norm Y` as it goes. GPT-2 is built from a small
config over a byte-level vocabulary of 256: nothing is downloaded. `--optim adafactor` and `--bf16`
are the TrainingArguments fields of those names, honoured as the plain Trainer does. At the end
`sw.save_pretrained` writes OUT/final (model.safetensors + config.json) for `from_pretrained`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sysconfig
from pathlib import Path

import torch

if not torch.cuda.is_available():  # transformers imports DeepSpeed where installed: name the device, not guess it
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import transformers  # noqa: E402 - after DS_ACCELERATOR
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

import shardwise as sw  # noqa: E402
from shardwise.integrations.transformers import ShardwiseTrainer  # noqa: E402 - shardwise


def byte_windows(seq: int, max_bytes: int = 1_000_000) -> list[dict]:
    """The standard library's .py files as non-overlapping windows of `seq` bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(path.read_bytes() for path in sorted(stdlib.glob("*.py"))[:200])[:max_bytes]
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return [{"input_ids": w, "labels": w} for w in tokens[: len(tokens) // seq * seq].view(-1, seq)]


class StepPrinter(TrainerCallback):
    """`step N loss X grad_norm Y` on rank 0 at every log, in place of the Trainer's dict lines."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" not in (logs or {}):
            return
        if state.is_world_process_zero:
            print(f"step {state.global_step} loss {logs['loss']:.4f} grad_norm {logs['grad_norm']:.4f}", flush=True)
        if not math.isfinite(logs["loss"]):
            raise SystemExit(f"loss is {logs['loss']} at step {state.global_step}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps (default: 100)")
    parser.add_argument("--strategy", default="zero3", choices=sw.STRATEGIES[1:], help="default: zero3")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch (default: 4)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step (default: 2)")
    parser.add_argument("--seq", type=int, default=128, help="bytes per sequence (default: 128)")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (default: 50)")
    parser.add_argument("--out", default="out/hf_trainer", help="output directory (default: out/hf_trainer)")
    parser.add_argument("--optim", default="adamw_torch", help="the Trainer's optim= (default: adamw_torch; "
                        "adafactor keeps factored state, saved and resumed like AdamW's)")
    parser.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): autocast the forward")
    args = parser.parse_args()
    torch.set_num_threads(1)                                  # one thread per rank (CPU)
    transformers.utils.logging.disable_progress_bar()         # no "Writing model shards" bar per checkpoint
    # Checkpoints written within a second of each other (short runs) make the Trainer's rotation say it
    # orders them by step number instead of mtime: the right order here, nothing to act on.
    logging.getLogger("transformers.trainer_utils").setLevel(logging.ERROR)

    sw.init()                                                                   # shardwise
    config = AutoConfig.for_model("gpt2", vocab_size=256, n_positions=args.seq, n_embd=128, n_layer=4,
                                  n_head=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.loss_type = "ForCausalLM"                           # GPT2LMHeadModel's name names no loss: else a warning
    sw.shard(model, strategy=args.strategy)                                     # shardwise

    training_args = TrainingArguments(
        output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulate, learning_rate=1e-3, weight_decay=0.1,
        max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=1,
        report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        save_strategy="steps", save_steps=args.save_every, save_total_limit=2, optim=args.optim, bf16=args.bf16)
    trainer = ShardwiseTrainer(model=model, args=training_args, train_dataset=byte_windows(args.seq))  # shardwise
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(StepPrinter())
    resume = get_last_checkpoint(args.out) if Path(args.out).is_dir() else None   # the newest checkpoint-N
    if resume is not None and trainer.is_world_process_zero():
        print(f"resuming from {resume}")
    trainer.train(resume_from_checkpoint=resume)
    sw.save_pretrained(model, Path(args.out) / "final")      # every rank calls it; rank 0 writes
    sw.shutdown()


if __name__ == "__main__":
    main()

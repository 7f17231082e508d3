"""Fine-tune a pretrained Hugging Face model, loaded straight into zero3 shards, and export it back.

    torchrun --standalone --nproc-per-node 2 examples/hf_finetune_pretrained.py --max-steps 100
    python examples/hf_finetune_pretrained.py --max-steps 20     # one process: the same script

`sw.from_pretrained` builds the model from the directory's `config.json` under `sw.deferred_init()`,
shards it, and each rank reads only its own rows of the weights: no rank ever holds the whole model.
Nothing can be downloaded here, so the "pretrained" directory is made the first time (a small Llama
over a byte-level vocabulary of 256, written by transformers' own `save_pretrained` in bf16 as several
files with `model.safetensors.index.json`, as a hub download looks); point `--pretrained` at a real
model directory (`hf download REPO --local-dir DIR`) for a real one. The loop is the usual one (`fit`
in examples/hf_causal_lm.py, on the same data): every `--save-every` steps `sw.save` writes a
checkpoint into `--out`, and started again with the same `--out` the script resumes from the newest
(model, optimizer, data position, RNG states). At the end `sw.save_pretrained` writes `OUT/hf/` in
several files (above `--shard-size`), which `AutoModelForCausalLM.from_pretrained` loads without
shardwise. Rank 0 prints `step N loss X`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from hf_causal_lm import fit  # its loop: AdamW, checkpoints, resume (this folder is on sys.path)
from transformers import AutoModelForCausalLM

import shardwise as sw


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pretrained", default="out/pretrained-llama",
                        help="a Hugging Face model directory; made here if missing (default: out/pretrained-llama)")
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps in all (default: 100)")
    parser.add_argument("--strategy", default="zero3", choices=sw.STRATEGIES, help="default: zero3")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default: 8)")
    parser.add_argument("--seq", type=int, default=128, help="bytes per sequence (default: 128)")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default: 3e-4)")
    parser.add_argument("--out", default="out/hf_finetune", help="checkpoint directory (default: out/hf_finetune)")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (default: 50)")
    parser.add_argument("--shard-size", default="100KB", help="save_pretrained's max_shard_size (default: 100KB)")
    return parser.parse_args()


def make_pretrained(directory: Path, shard_size: str) -> None:
    """Stand-in for a download: a small Llama written by save_pretrained in bf16, several files."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")            # transformers' save_pretrained reaches DeepSpeed where
                                                              # installed: name the device, not guess it (and say so)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory, max_shard_size=shard_size)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)                                  # one thread per rank (CPU)
    transformers.utils.logging.disable_progress_bar()         # save_pretrained's per-file bar
    sw.init()                                                 # torchrun's environment, or one process
    rank = sw.get_rank()
    pretrained = Path(args.pretrained)
    if rank == 0 and not (pretrained / "config.json").exists():
        make_pretrained(pretrained, args.shard_size)
    dist.barrier()                                            # the directory is whole before any rank reads it

    model = sw.from_pretrained(AutoModelForCausalLM, pretrained, strategy=args.strategy)
    fit(model, args)                                          # the usual loop, as examples/hf_causal_lm.py runs it
    sw.save_pretrained(model, Path(args.out) / "hf", max_shard_size=args.shard_size)
    if rank == 0:
        print(f"from_pretrained reads {Path(args.out) / 'hf'}")
    sw.shutdown()


if __name__ == "__main__":
    main()

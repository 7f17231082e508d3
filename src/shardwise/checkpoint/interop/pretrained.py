"""`sw.from_pretrained`: a Hugging Face model built from its pretrained directory straight into shards, the
one-call form of `sw.deferred_init()` + `sw.shard` + `sw.load` (Note [Hugging Face directories] in
read/hf_dir.py), as `AutoModelForCausalLM.from_pretrained` is transformers' one call."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shardwise.checkpoint.read.hf_dir import HF_INDEX, SINGLE
from shardwise.checkpoint.read.load import load
from shardwise.engine.api import shard
from shardwise.engine.init.deferred import deferred_init
from shardwise.errors import ShardwiseError


def from_pretrained(model_class, path, *, strategy: str = "zero3", config=None, dtype: torch.dtype = torch.float32,
                    strict: bool = True, output_loading_info: bool = False, **shard_options) -> nn.Module:
    """Build `model_class` (a transformers model class, `LlamaForCausalLM`, or an Auto class,
    `AutoModelForCausalLM`) from the Hugging Face model directory `path`, sharded; every rank calls it.

    The model is built under `sw.deferred_init()` from `path`'s `config.json` (or `config=`), so no rank
    ever holds it whole; `sw.shard(model, strategy=strategy, **shard_options)` gives each rank its rows
    (`units`, `precision`, `mesh`, ... as `sw.shard` takes them); then `sw.load(path, model, strict=strict)`
    reads each rank's rows of the pretrained weights, the names matched as `from_pretrained` matches them.
    The parameters are `dtype` (float32 masters by default) whatever dtype the files hold, not the
    config's `dtype` (a bf16 file converts exactly; `precision="bf16"` computes in bf16). Like
    transformers' `from_pretrained`, the model is returned in eval mode (call `model.train()` to
    fine-tune), with the `LoadReport` too when `output_loading_info`.
    No code from the directory runs: a config naming remote code (`auto_map`) is refused by transformers.
    """
    path = Path(path)
    if path.name == HF_INDEX:
        path = path.parent
    if not (path / HF_INDEX).exists() and not (path / SINGLE).exists():
        raise ShardwiseError(f"{path} holds no {SINGLE} and no {HF_INDEX}: pass a Hugging Face model directory "
                             "(as save_pretrained or `hf download REPO --local-dir DIR` writes it)")
    if config is None:
        import transformers

        config_class = getattr(model_class, "config_class", None) or transformers.AutoConfig
        config = config_class.from_pretrained(path)
    build = getattr(model_class, "from_config", None) or getattr(model_class, "_from_config", None)
    if build is None:
        raise ShardwiseError(f"{getattr(model_class, '__name__', model_class)} is not a transformers model class "
                             "(no from_config / _from_config): build your model under sw.deferred_init(), "
                             "sw.shard it, then sw.load(path, model)")
    with deferred_init():
        model = build(config, dtype=dtype)
    shard(model, strategy=strategy, **shard_options)
    report = load(path, model, strict=strict)
    model.eval()
    return (model, report) if output_loading_info else model

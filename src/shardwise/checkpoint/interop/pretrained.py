"""`sw.from_pretrained`: a Hugging Face model built from its pretrained directory straight into shards, the
one-call form of `sw.deferred_init()` + `sw.shard` + `sw.load` (Note [Hugging Face directories] in
read/hf_dir.py), as `AutoModelForCausalLM.from_pretrained` is transformers' one call."""

from __future__ import annotations

from contextlib import nullcontext
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
    With `strict=True` (the default) no random initialization is drawn: every parameter takes its value from
    the files or the load refuses before any changes (Note [no init before a strict load]).
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
    skipped = _skipped_init(model_class, config, strict)
    with deferred_init():
        with skipped:
            model = build(config, dtype=dtype)
        if not isinstance(skipped, nullcontext):
            model.tie_weights()  # no_init_weights skips init_weights, which ties them too (before sw.shard: one value)
    shard(model, strategy=strategy, **shard_options)
    report = load(path, model, strict=strict)
    model.eval()
    return (model, report) if output_loading_info else model


def _skipped_init(model_class, config, strict: bool):
    """Note [no init before a strict load]: transformers' `from_pretrained` builds the model with its weight
    initialization switched off (`no_init_weights`: `init_weights` and `torch.nn.init`'s functions do nothing),
    since the files overwrite every value. Built under `sw.deferred_init()` with it on, `sw.shard` would replay
    that initialization on every rank, drawing random values for every element of the whole model (each
    `nn.Linear`'s kaiming draw, then the model's own `normal_`) only to throw them away: the count that made
    `sw.from_pretrained` slower than `from_pretrained` + `sw.shard` (bench/checkpoints/results/hf_load.md). Under
    `strict=True` every parameter is loaded or the load refuses before anything changes, so no value drawn
    could survive; buffers the model computes (rotary frequencies, masks) are torch ops, not initializers, and
    are still replayed. With `strict=False`, or a class whose `_keys_to_ignore_on_load_missing` lets tensors be
    absent from the files, a tensor the files lack keeps its initial value, so it is drawn."""
    mapping = getattr(model_class, "_model_mapping", None)  # an Auto class: the class it builds for `config`
    concrete = mapping.get(type(config), model_class) if mapping is not None else model_class
    if not strict or getattr(concrete, "_keys_to_ignore_on_load_missing", None):
        return nullcontext()
    from transformers.initialization import no_init_weights

    return no_init_weights()

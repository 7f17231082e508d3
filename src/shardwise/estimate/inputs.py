"""The inputs the activation probe feeds a model: the one place the estimator knows model families.

A model's inputs come, in order, from:
1. `inputs=`: a callable `(batch, seq, device) -> dict | tuple | tensor` the user gives
   (`--inputs module:function` on the command line);
2. the model's own `example_inputs(batch, seq, device)` (shardwise.interfaces.ExampleInputs, as
   the zoo GPT has);
3. a Hugging Face model's config: `input_ids` of shape [batch, seq] below `config.vocab_size`
   (with `labels`, so the model computes its own loss), or a vision model's `pixel_values`
   [batch, config.num_channels, config.image_size, config.image_size];
4. else the probe cannot guess, and says which of the two to give.
Only shapes and dtypes matter: on the meta device the values are never read.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.interfaces import ExampleInputs

InputMaker = Callable[[int, int | None, torch.device], Any]


def make_inputs(model: nn.Module, batch: int, seq: int | None, device: torch.device,
                inputs: InputMaker | None = None) -> Any:
    """The model's inputs for `batch` samples of `seq` tokens on `device` (module docstring)."""
    if inputs is not None:
        return inputs(batch, seq, device)
    if isinstance(model, ExampleInputs):  # the model makes its own (shardwise.models.gpt)
        return model.example_inputs(batch, seq, device)
    config = getattr(model, "config", None)
    accepts = _parameters_of(model)
    if config is not None and "input_ids" in accepts and getattr(config, "vocab_size", None):
        seq = seq if seq is not None else default_seq(model)
        if seq is None:
            raise ShardwiseError(f"{type(model).__name__}'s config has no maximum length: pass seq= (--seq)")
        ids = _tokens(batch, seq, config.vocab_size, device)
        made = {"input_ids": ids}
        if "labels" in accepts:  # the model computes its own loss (a seq2seq model also its decoder's inputs)
            made["labels"] = ids
        return made
    if config is not None and "pixel_values" in accepts and getattr(config, "image_size", None):
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        channels = getattr(config, "num_channels", 3)
        return {"pixel_values": torch.randn(batch, channels, size, size, device=device)}
    raise ShardwiseError(
        f"the activation probe cannot build inputs for {type(model).__name__}: pass inputs= (a function "
        "(batch, seq, device) -> the model's inputs; `--inputs module:function` on the command line). "
        "Hugging Face models with input_ids or pixel_values need none")


def default_seq(model: nn.Module) -> int | None:
    """A Hugging Face model's maximum length, when its config has one."""
    config = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def call(model: nn.Module, made: Any):
    """`model(**made)`, `model(*made)` or `model(made)`."""
    if isinstance(made, dict):
        return model(**made)
    if isinstance(made, (tuple, list)):
        return model(*made)
    return model(made)


def loss_of(output) -> torch.Tensor:
    """The scalar backward starts from: the output's `.loss` (Hugging Face with labels), the
    output itself when it is a scalar, else the mean of its first floating tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict):
        output = list(output.values())
    elif hasattr(output, "to_tuple"):
        output = output.to_tuple()
    for tensor in output if isinstance(output, (tuple, list)) else [output]:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.requires_grad:
            return tensor if tensor.dim() == 0 else tensor.float().mean()
    raise ShardwiseError("the model's output holds no tensor to run backward from: make inputs= include what "
                         "makes the model return a loss")


def _tokens(batch: int, seq: int, vocab: int, device: torch.device) -> torch.Tensor:
    if torch.device(device).type == "meta":
        return torch.empty(batch, seq, dtype=torch.long, device=device)
    return torch.randint(0, vocab, (batch, seq), device=device)


def _parameters_of(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()

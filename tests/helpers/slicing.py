"""Rank functions for the slicing tests (tests/test_slicing.py): one model sliced over a tensor
group and, on a 2-D mesh, sharded with zero3 over the data group, trained with the one loop
(shardwise.testing.train) and compared with the single process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shardwise as sw
from shardwise.models.zoo import ZOO, ZooSpec
from shardwise.testing import RunResult, make_optimizer, train

LLAMA_VOCAB, LLAMA_SEQ = 128, 8


class LlamaLM(nn.Module):
    """A tiny Hugging Face Llama with the zoo's interface: forward(x, y) -> mean next-token loss.

    The loss is `F.cross_entropy` on the head's logits, so on a sliced model it runs on the
    vocabulary slices (Note [sliced logits])."""

    def __init__(self, kv_heads: int = 2) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads,
                             intermediate_size=128, num_hidden_layers=2, vocab_size=LLAMA_VOCAB,
                             max_position_embeddings=LLAMA_SEQ, attn_implementation="sdpa")
        self.lm = LlamaForCausalLM(config)
        self.seed = 0

    def begin_step(self, step: int) -> None:
        pass

    def forward(self, x, y):
        logits = self.lm(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _llama_batch(g: torch.Generator, n: int):
    seq = torch.randint(0, LLAMA_VOCAB, (n, LLAMA_SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _llama_unit():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    return LlamaDecoderLayer


MODELS = {
    "gpt": ZOO["gpt"],
    "llama": ZooSpec("llama", lambda: LlamaLM(2), _llama_batch, None, False),
    "llama_kv4": ZooSpec("llama_kv4", lambda: LlamaLM(4), _llama_batch, None, False),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name].build()
    model.seed = seed
    return model


def reference(name: str, steps: int = 5, global_batch_size: int = 8) -> RunResult:
    """One process, the whole global batch."""
    return train(build(name), MODELS[name], steps, global_batch_size)


def _average(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t.item()


def run_mesh(name: str, data: int, tensor: int, strategy: str | None, steps: int = 5,
             global_batch_size: int = 8) -> RunResult:
    """On this rank of a data x tensor mesh: slice over "tensor", shard with `strategy` over "data"
    (None: no sharding), train; full (unsliced, unsharded) parameters at the end."""
    mesh = init_device_mesh("cpu", (data, tensor), mesh_dim_names=("data", "tensor"))
    model = build(name)
    ndim_by_name = {n: p.ndim for n, p in model.named_parameters()}
    sw.slice(model, group=mesh)
    spec = MODELS[name]
    if strategy is not None:
        units = spec.unit_class or (_llama_unit() if name.startswith("llama") else None)
        sw.shard(model, strategy=strategy, units=units, process_group=mesh["data"].get_group())
    optimizer = make_optimizer(model, ndim_by_name=ndim_by_name)
    return train(model, spec, steps, global_batch_size, rank=mesh["data"].get_local_rank(), world_size=data,
                 optimizer=optimizer, all_reduce_loss=_average, gather_params=lambda: sw.full_parameters(model))

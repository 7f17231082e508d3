"""`frozen="host"` under a PEFT LoRA model: the base (tied embedding/head included) is one host
copy, the adapters train under the strategy, and the result equals one process's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.engine.memory.host_param import is_host_shared
from shardwise.models.gpt import GPT, Block, GPTConfig
from shardwise.testing import RunResult, assert_close_runs

peft = pytest.importorskip("peft")

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=2)
STEPS, GLOBAL_BATCH = 4, 8


def _lora_gpt():
    torch.manual_seed(0)
    base = GPT(CFG)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "attn_proj"], lora_dropout=0.0,
                             init_lora_weights="gaussian")  # B nonzero too: a wrong A gradient shows at once
    return peft.get_peft_model(base, config)


def _batch(step: int):
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(CFG.vocab_size, (GLOBAL_BATCH, CFG.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model, rank: int, world: int, average) -> RunResult:
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-3)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        loss = model(x[rows], y[rows])
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(average(loss.item()))
    return RunResult(losses, [], {n: p.detach().clone() for n, p in sw.full_parameters(model).items()})


def _lora_on_rank(strategy):
    model = _lora_gpt()
    kwargs = {"units": Block} if strategy != "ddp" else {}
    sw.shard(model, strategy=strategy, frozen="host", **kwargs)
    shared = {n for n, p in model.named_parameters() if is_host_shared(p)}
    tied = model.base_model.model.head.weight is model.base_model.model.tok_emb.weight

    def average(value):
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        return t.item()

    result = _train(model, dist.get_rank(), dist.get_world_size(), average)
    return result, shared, tied


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_lora_adapters_over_a_host_shared_base_equal_one_process(ranks, strategy):
    """Catches PEFT's wrapped base layers (`base_layer.weight`), the tied embedding/head, or the
    adapters' gradients through the mapped base going wrong under the host copy."""
    reference_model = _lora_gpt()
    frozen = {n for n, p in reference_model.named_parameters() if not p.requires_grad}
    reference = _train(reference_model, 0, 1, lambda v: v)
    for result, shared, tied in ranks.run(_lora_on_rank, 2, strategy):
        assert shared == frozen and tied
        assert_close_runs(reference, result)

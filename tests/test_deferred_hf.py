"""sw.deferred_init() around Hugging Face models built from configs: values equal eager
construction bitwise, at any world size (transformers is installed by `make`: the hf extra)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw

CONFIGS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_embd=32, n_head=4, vocab_size=300, n_positions=32)),
    "bert": ("BertConfig", "BertForMaskedLM", dict(vocab_size=300, hidden_size=32, num_hidden_layers=2,
                                                   num_attention_heads=4, intermediate_size=64,
                                                   max_position_embeddings=64)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=300, hidden_size=32, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2,
                                                      intermediate_size=64)),
}


def _build(name):
    import transformers

    config_class, model_class, kwargs = CONFIGS[name]
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs))


def _deferred_rows_equal_eager(name, strategy):
    torch.manual_seed(0)
    eager_model = _build(name)
    eager = dict(eager_model.named_parameters())
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager_loss = eager_model(input_ids=ids, labels=ids).loss
    torch.manual_seed(0)
    with sw.deferred_init():
        model = _build(name)
    on_meta = {p.device.type for p in model.parameters()} == {"meta"}
    sw.shard(model, strategy=strategy)
    # Buffers built on meta too (Llama's rotary inv_freq stayed there, or held garbage under ddp).
    differ = [n for n, b in eager_model.named_buffers() if not torch.equal(dict(model.named_buffers())[n], b)]
    with torch.no_grad():
        if not torch.equal(model(input_ids=ids, labels=ids).loss, eager_loss):
            differ.append("loss")
    if strategy == "ddp":
        return on_meta, differ + [n for n, p in model.named_parameters() if not torch.equal(p, eager[n])], 0
    for param_name, info in sw.shard_info(model).items():
        full = eager[param_name].detach()
        expected = full.reshape(-1)[info.row_start:info.row_end] if full.dim() == 0 else \
            full[info.row_start:info.row_end]
        if not torch.equal(info.rows.reshape(expected.shape), expected):
            differ.append(param_name)
    return on_meta, differ, dist.get_rank()


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_model_deferred_equals_eager(ranks, name, strategy):
    """Catches transformers skipping its weight init on the meta device (GPT-2's wte came out
    with std 1.0 instead of 0.02, 4.3 away from eager), and an in-place write to part of a
    parameter (BERT's padding row) replayed as if it created the whole tensor, and buffers left on
    meta (Llama's rotary inv_freq: its first forward failed) or uninitialized (ddp)."""
    for on_meta, differ, rank in ranks.run(_deferred_rows_equal_eager, 2, name, strategy, timeout=180):
        assert on_meta and differ == [], (rank, differ)


class _Padded(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)  # normal_, then fill_ of row 0
        with torch.no_grad():
            self.emb.weight[3].mul_(2.0)  # a partial in-place write after the init


def test_partial_in_place_writes_replay_exactly():
    """Catches an in-place op on a view (which returns its input) taken for the creation of the
    parameter: the init before it was then replayed as a scratch draw and the weight left zeros."""
    from shardwise.engine.init.deferred import replay

    torch.manual_seed(0)
    eager = _Padded().emb.weight.detach()
    torch.manual_seed(0)
    with sw.deferred_init():
        model = _Padded()
    values = {}
    replay({n: p.detach() for n, p in model.named_parameters()}, lambda n, v: values.__setitem__(n, v.clone()))
    assert torch.equal(values["emb.weight"], eager)

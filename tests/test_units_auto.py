"""units="auto" (Note [auto units]) on Hugging Face architectures built from configs, the other
forms of `units=`, `sw.describe`, and `sw.save_pretrained` round-tripping through `from_pretrained`."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise.engine.unit.units import build_units
from shardwise.testing import RunResult, assert_close_runs

SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
ARCHITECTURES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=16,
                                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "bert": ("BertConfig", "BertForMaskedLM", dict(SMALL, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(vocab_size=128, d_model=32, d_ff=64, num_layers=2,
                                                          num_heads=4, d_kv=8, dropout_rate=0.0,
                                                          decoder_start_token_id=0, pad_token_id=0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(SMALL, num_key_value_heads=2)),
    "vit": ("ViTConfig", "ViTForImageClassification", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                           intermediate_size=64, image_size=16, patch_size=8,
                                                           num_labels=5, hidden_dropout_prob=0.0,
                                                           attention_probs_dropout_prob=0.0)),
}


def build_hf(name: str, seed: int = 0) -> nn.Module:
    import transformers

    config_class, model_class, kwargs = ARCHITECTURES[name]
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs)).eval()


def batch(name: str, step: int, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(step)
    if name == "vit":
        pixels = torch.randn(n, 3, 16, 16, generator=g)
        return {"pixel_values": pixels, "labels": torch.randint(0, 5, (n,), generator=g)}
    ids = torch.randint(0, 128, (n, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_auto_units_leave_only_embeddings_heads_and_norms_in_the_root(name):
    """Catches a default that leaves most of a model in the root (T5's encoder under the
    largest-ModuleList rule; nn.Sequential blocks; units=nn.Conv2d on GPT-2), silently."""
    model = build_hf(name)
    plans = build_units(model, "auto")
    root = plans[0].params
    total = sum(p.numel() for p in model.parameters())
    assert len(plans) > 2
    assert sum(o.param.numel() for o in root) * 2 < total
    allowed = ("emb", "wte", "wpe", "shared", "lm_head", "norm", "ln_f", "cls", "pooler", "classifier",
               "head", "final_layer_norm", "layernorm", "patch", "cls_token", "position")
    assert all(any(word in o.name.lower() for word in allowed) for o in root), [o.name for o in root]
    with warnings.catch_warnings():
        warnings.simplefilter("error", sw.ShardwiseWarning)
        from shardwise.engine.unit.unit_choice import warn_if_root_holds_most
        warn_if_root_holds_most(model, [o.param for o in root])


def _train(name: str, sharded: bool) -> RunResult:
    model = build_hf(name)
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    if sharded:
        sw.shard(model, strategy="zero3")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    losses = []
    for step in range(3):
        inputs = {k: v.chunk(world)[rank] for k, v in batch(name, step).items()}
        loss = model(**inputs).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        value = loss.detach().double()
        if sharded:
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        losses.append(value.item())
    params = sw.full_parameters(model) if sharded else {n: p.detach().clone() for n, p in model.named_parameters()}
    return RunResult(losses, [], params)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_hf_architectures_under_zero3_match_one_process(ranks, name):
    """Catches an automatic plan that trains wrongly: 3 AdamW steps of zero3 at world size 2
    with units='auto' against one process on the whole batch."""
    reference = _train(name, sharded=False)
    for result in ranks.run(_train, 2, name, True, timeout=180):
        assert_close_runs(reference, result, rtol=1e-5, atol=1e-5)


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.big = nn.Linear(8, 200)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.big(x)


def test_units_take_instances_names_and_say_what_is_wrong():
    """Catches units=<a ModuleList> failing inside torch ('missing the required forward'),
    names that match nothing, and a plan that keeps most parameters in the root silently."""
    model = _Mixed()
    by_instance = [p.path for p in build_units(model, model.blocks)]
    by_names = [p.path for p in build_units(model, ["blocks.0", "big"])]
    assert by_instance == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert by_names == ["", "blocks.0", "big"]
    with pytest.raises(sw.ShardwiseError, match="no module of that name"):
        build_units(model, ["blocks.9"])
    with pytest.raises(sw.ShardwiseError, match="is not understood"):
        build_units(model, 3)
    table = str(sw.describe(model, units=model.blocks, world_size=4))
    assert "<root>" in table and "blocks.2" in table and "Linear" in table
    from shardwise.engine.unit.unit_choice import warn_if_root_holds_most
    root = build_units(model, model.blocks)[0].params
    with pytest.warns(sw.ShardwiseWarning, match="big"):
        warn_if_root_holds_most(model, [o.param for o in root])


def test_the_root_named_as_the_unit_is_not_warned_about():
    """Catches the root-holds-most warning for a caller who chose the root as its one unit (`units=[model]`:
    a small pipeline stage, Note [a stage as one unit]), while "auto" and a split that leaves most in the root
    still get it."""
    from shardwise.engine.unit.unit_choice import names_the_root
    model = _Mixed()
    assert names_the_root(model, [model]) and names_the_root(model, lambda module: module is model)
    assert not names_the_root(model, "auto") and not names_the_root(model, None)
    assert not names_the_root(model, model.blocks) and not names_the_root(model, ["blocks.0"])


def _warnings_of_shard(units: str) -> list[str]:
    model = _Mixed()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sw.shard(model, strategy="zero3", units=[model] if units == "root" else model.blocks)
    return [str(w.message) for w in caught if issubclass(w.category, sw.ShardwiseWarning)]


def test_shard_with_the_root_as_its_unit_does_not_warn(ranks):
    """Catches sw.shard warning that the root holds most of the parameters when the caller named the root as
    the unit (a small pipeline stage's choice), while a split leaving most in the root still warns."""
    chosen = ranks.run(_warnings_of_shard, 1, "root", timeout=60)[0]
    split = ranks.run(_warnings_of_shard, 1, "blocks", timeout=60)[0]
    assert chosen == [], chosen
    assert any("root unit holds" in message for message in split), split


def _save_pretrained(directory):
    model = build_hf("gpt2")
    sw.shard(model, strategy="zero3")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = {k: v.chunk(2)[dist.get_rank()] for k, v in batch("gpt2", 0).items()}
    model(**inputs).loss.backward()
    optim.step()
    sw.save_pretrained(model, directory)
    full = sw.full_parameters(model)
    if dist.get_rank() != 0:
        return True
    import transformers

    loaded = transformers.GPT2LMHeadModel.from_pretrained(directory)
    tied = loaded.lm_head.weight is loaded.transformer.wte.weight
    return tied and all(torch.equal(full[n], p) for n, p in loaded.named_parameters())


def test_save_pretrained_round_trips_through_from_pretrained(ranks, tmp_path):
    """Catches an export from_pretrained cannot read without a hand-copied config.json, or one
    that loads other values (a rank's rows, an untied head)."""
    assert all(ranks.run(_save_pretrained, 2, str(tmp_path / "gpt2"), timeout=180))


def test_auto_units_pick_blocks_not_the_linears_of_a_tied_gpt():
    """Catches the tied head's weight counting for nn.Linear (it is held by the embedding too),
    which made 'auto' cut a GPT into Linears instead of Blocks; and a block class losing to its
    own Linears when the head adds a little (the zoo's frozen model)."""
    from shardwise.models.zoo import ZOO, build

    assert [p.path for p in build_units(build("gpt"), "auto")] == ["", "blocks.0", "blocks.1"]
    frozen = [p.path for p in build_units(ZOO["frozen"].build(), "auto")]
    assert frozen == ["", "layers.0", "layers.1", "layers.2"]


class _Untied(nn.Module):
    """An embedding and an untied head of its shape around two small blocks: the root holds 98%."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 1000, bias=False)


def test_no_warning_that_units_cannot_act_on():
    """Catches issue 44 item 16: units="auto" on a model with untied embeddings warned that the root holds
    most of the parameters and to pass units=, which cannot split an embedding and its head."""
    from shardwise.engine.unit.unit_choice import warn_if_root_holds_most

    model = _Untied()
    root = build_units(model, model.blocks)[0].params
    with warnings.catch_warnings():
        warnings.simplefilter("error", sw.ShardwiseWarning)
        warn_if_root_holds_most(model, [o.param for o in root])

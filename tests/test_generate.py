"""`generate()` on a zero3-sharded Hugging Face model when ranks generate different numbers of tokens:
a clear error naming the fix, and the fix (`synced_gpus=True`) equal to one process."""

from __future__ import annotations

import copy

import torch

import shardwise as sw


def _generate(synced: bool):
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32)).eval()
    whole = copy.deepcopy(model)
    sw.shard(model, strategy="zero3")
    rank = sw.get_rank()
    prompt = torch.tensor([[1 + rank, 2, 3]])
    tokens = 3 + 2 * rank  # rank 0 stops after 3 new tokens, rank 1 after 5
    options = dict(max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    expected = whole.generate(prompt, **options)
    try:
        got = model.generate(prompt, synced_gpus=synced, **options)
        model(prompt)  # the script goes on (the next batch, a loss): a rank that finished early runs a forward
    except sw.ShardwiseError as error:
        return str(error)
    return torch.equal(got, expected)


def test_uneven_generate_fails_with_the_fix_in_the_message(ranks):
    """Catches ranks generating different numbers of tokens failing without the fix in the message: once
    the rank that finished early runs its next forward, every rank raises a ShardwiseError that names
    synced_gpus=True (a rank that ended the program instead would leave the others waiting in a
    collective until the process group's timeout: docs/strategies.md)."""
    for result in ranks.run(_generate, 2, False, timeout=120):
        assert isinstance(result, str) and "synced_gpus=True" in result, result


def test_uneven_generate_with_synced_gpus_equals_one_process(ranks):
    """Catches the documented pattern not working: with synced_gpus=True each rank's tokens equal
    the unsharded model's on its own prompt."""
    assert ranks.run(_generate, 2, True, timeout=120) == [True, True]

"""sw.save_pretrained of a sharded PEFT (LoRA) model writes what PEFT writes: the adapters, whole,
which PeftModel.from_pretrained reads back (issue 11)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw

pytest.importorskip("peft")


def _build():
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=16)
    base = transformers.GPT2LMHeadModel(config)
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False)  # nonzero B: a real test
    return peft.get_peft_model(base, lora)


def _save_and_reload(directory: str, strategy: str):
    import os

    import peft

    model = _build()
    expected = {k: v.clone() for k, v in peft.get_peft_model_state_dict(model).items()}
    sw.shard(model, strategy=strategy)
    sw.save_pretrained(model, directory)
    dist.barrier()
    reloaded = peft.PeftModel.from_pretrained(_build().get_base_model(), directory)
    got = peft.get_peft_model_state_dict(reloaded)
    problems = sorted(set(got) ^ set(expected)) + [k for k, v in expected.items() if not torch.equal(got[k], v)]
    return problems, sorted(os.listdir(directory))


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_save_pretrained_of_a_sharded_peft_model_round_trips(ranks, tmp_path, strategy):
    """Catches a sharded LoRA model saved as a whole merged model (model.safetensors of the base
    and adapters, which PeftModel.from_pretrained cannot read) or with this rank's adapter rows."""
    for problems, files in ranks.run(_save_and_reload, 2, str(tmp_path / strategy), strategy, timeout=180):
        assert problems == [] and "adapter_model.safetensors" in files, (problems, files)

"""Hugging Face directories into shards, continued (issue 59): fp16 files, no random initialization drawn before a
strict load (Note [no init before a strict load] in checkpoint/interop/pretrained.py), and the keys a model class
says may be absent (`_keys_to_ignore_on_load_missing`). Against what `from_pretrained` gives in one process."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from helpers.hf_dirs import CONFIGS, config, load_and_compare, model_class, reference, tokens, write_pretrained

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp16_dir_into_zero3_equals_from_pretrained(ranks, tmp_path, name):
    """Catches an fp16 Hugging Face directory read other than `from_pretrained(dtype=float32)` reads it: its 2 bytes
    taken for bf16's, another rank's rows, a conversion that rounds (fp16 to fp32 is exact) or a report that does
    not say it converted. zero3 at 2 ranks, every row and the logits on a batch bitwise."""
    directory = write_pretrained(name, tmp_path / name, torch.float16)
    expected = reference(name, directory, tokens())[0]
    for rank, differ, ok, notes in ranks.run(load_and_compare, 2, name, directory, "zero3", expected, timeout=180):
        assert ok and differ == [], (rank, differ)
        assert any("torch.float16 were converted to the model's torch.float32 (exactly)" in n for n in notes), notes


def _random_draws(name, directory, strict):
    """A rank function: the elements random initializers drew while sw.from_pretrained built and loaded the model."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    class Draws(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ("normal_", "uniform_") and out.device.type != "meta":
                Draws.elements += out.numel()
            return out

    with Draws():
        model = sw.from_pretrained(model_class(name), directory, strategy="zero3", strict=strict)
    expected, logits = reference(name, directory, tokens())
    differ = [n for n, v in sw.full_state_dict(model).items() if not torch.equal(v, expected[n])]
    with torch.no_grad():  # the rotary frequencies (buffers the model computes, not initializes) still right
        differ += [] if torch.equal(model(input_ids=tokens()).logits, logits) else ["logits"]
    return dist.get_rank(), Draws.elements, differ


def test_from_pretrained_draws_no_init_before_a_strict_load(ranks, tmp_path):
    """Catches sw.from_pretrained replaying the model's random initialization on every rank (every element of the
    whole model drawn, twice for a Linear: its kaiming draw, then the model's normal_) only for the files to
    overwrite it: what made it 3x slower than from_pretrained + sw.shard (bench/checkpoints/hf_load_counts.py).
    strict=True draws nothing and loads from_pretrained's values and logits (the rotary frequencies, computed
    rather than initialized, still replayed); strict=False (a parameter the files lack keeps its initial value)
    still draws."""
    directory = write_pretrained("llama", tmp_path / "llama", torch.bfloat16)
    for strict in (True, False):
        for rank, drawn, differ in ranks.run(_random_draws, 2, "llama", directory, strict, timeout=180):
            assert differ == [], (rank, differ)
            assert (drawn == 0) == strict, (rank, strict, drawn)


def _one_file(model, directory, change):
    """`model` written by save_pretrained in one file, then that file rewritten with `change(tensors)` applied."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_keys_transformers_lets_be_absent_or_ignores_are_honoured(tmp_path):
    """Catches a strict sw.load refusing a Hugging Face file that from_pretrained loads: a tensor the model's class
    lets be absent (`_keys_to_ignore_on_load_missing`: Pegasus' final_logits_bias) counted missing, and the rotary
    frequencies older releases stored (`rotary_emb.inv_freq`, which transformers ignores in any model holding
    that buffer) counted unexpected. Both load, the report's notes name them, the values are from_pretrained's."""
    import transformers

    torch.manual_seed(0)
    pegasus_config = transformers.PegasusConfig(vocab_size=96, d_model=16, encoder_layers=1, decoder_layers=1,
                                                encoder_attention_heads=2, decoder_attention_heads=2,
                                                encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)
    cls = transformers.PegasusForConditionalGeneration
    assert "final_logits_bias" in cls._keys_to_ignore_on_load_missing
    directory = _one_file(cls(pegasus_config), tmp_path / "pegasus", lambda t: t.pop("final_logits_bias"))
    expected = cls.from_pretrained(directory).state_dict()
    for path in (directory, directory / "model.safetensors"):  # the directory, or its one file
        fresh = cls(pegasus_config)
        report = sw.load(path, fresh)
        assert report.ok and any("final_logits_bias" in n and "_keys_to_ignore_on_load_missing" in n
                                 for n in report.notes), report
        assert [k for k, v in fresh.state_dict().items() if not torch.equal(v, expected[k])] == []

    old_key = "model.layers.0.self_attn.rotary_emb.inv_freq"
    llama = model_class("llama")(config("llama"))
    directory = _one_file(llama, tmp_path / "llama", lambda t: t.update({old_key: torch.ones(4)}))
    fresh = model_class("llama")(llama.config)
    report = sw.load(directory, fresh)
    assert report.ok and any("transformers ignores" in n and old_key in n for n in report.notes), report
    assert all(torch.equal(v, llama.state_dict()[k]) for k, v in fresh.state_dict().items())

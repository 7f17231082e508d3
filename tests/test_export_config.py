"""What a checkpoint knows about its model, and where every rank writes it: the Hugging Face config
recorded at save and written by `shardwise ckpt export` and `sw.export` (Note [model config] in
checkpoint/save.py), and the one shared directory a save needs (Note [one shared directory])."""

from __future__ import annotations

import os

import pytest
import torch

import shardwise as sw
from shardwise import cli


def _llama():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=True))


def _assert_same_weights(loaded, model) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_ckpt_export_writes_the_config_from_pretrained_needs(tmp_path, capsys):
    """Catches `shardwise ckpt export` writing no config.json: from_pretrained on the export failed
    ("Unrecognized model") where sw.save_pretrained worked. The config is recorded at save."""
    import transformers

    model = _llama()
    sw.save(tmp_path / "ckpt", model)
    out = tmp_path / "export" / "model.safetensors"
    assert cli.main(["ckpt", "export", str(tmp_path / "ckpt"), str(out), "--mkdir"]) == 0
    assert "config.json" in capsys.readouterr().out
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out.parent)
    assert type(loaded) is type(model) and loaded.config.tie_word_embeddings
    _assert_same_weights(loaded, model)


def test_ckpt_export_says_when_the_checkpoint_does_not_know_its_model(tmp_path, capsys):
    """Catches an export that silently writes no config: a checkpoint of a plain torch model records
    none, and the command says so, with the fix."""
    from shardwise.models.zoo import build

    sw.save(tmp_path / "ckpt", build("reused_block"))
    assert cli.main(["ckpt", "export", str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")]) == 0
    assert "no config.json" in capsys.readouterr().out
    assert not (tmp_path / "config.json").exists()


def test_sw_export_writes_the_config_beside_the_weights(tmp_path):
    """Catches sw.export of a Hugging Face model leaving from_pretrained without a config."""
    import transformers

    model = _llama()
    sw.export(model, tmp_path / "model.safetensors")
    _assert_same_weights(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), model)


def _save_to_own_directory(root):
    """Each rank passes a directory only it sees: a node-local disk, as two nodes would."""
    model = torch.nn.Linear(4, 4)
    sw.shard(model, strategy="zero3")
    try:
        sw.save(os.path.join(root, f"node{sw.get_rank()}", "ckpt"), model)
    except sw.ShardwiseError as error:
        return str(error)
    return None


def _save_shared(root):
    model = torch.nn.Linear(4, 4)
    sw.shard(model, strategy="zero3")
    sw.save(os.path.join(root, "ckpt"), model)


def test_node_local_directories_are_refused_at_the_first_save(ranks, tmp_path):
    """Catches a raw FileNotFoundError for another rank's file when each node has its own checkpoint
    directory: the first save fails on every rank saying a shared file system is needed, and leaves
    nothing behind; a shared directory's checkpoint holds no trace of the check."""
    errors = ranks.run(_save_to_own_directory, 2, str(tmp_path), timeout=60)
    for error in errors:
        assert error is not None and "shares" in error and "file system" in error, error
    assert not list((tmp_path / "node0").iterdir())  # the partial directory was removed
    ranks.run(_save_shared, 2, str(tmp_path), timeout=60)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["index.json", "rank-00000-of-00002.safetensors",
                                                    "rank-00001-of-00002.safetensors"]


@pytest.mark.parametrize("hf", [True, False])
def test_the_config_is_in_the_index_only_for_hugging_face_models(tmp_path, hf):
    """Catches a config recorded for a model that has none (or lost for one that has one)."""
    from shardwise.checkpoint.schema import read_index
    from shardwise.models.zoo import build

    model = _llama() if hf else build("reused_block")
    sw.save(tmp_path / "ckpt", model)
    recorded = read_index(tmp_path / "ckpt").model_config
    assert (recorded is not None) == hf
    if hf:
        assert recorded["model_type"] == "llama" and recorded["hidden_size"] == 16

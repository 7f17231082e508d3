"""What a checkpoint knows about its model, and where every rank writes it: the Hugging Face config
recorded at save and written by `shardwise ckpt export` and `sw.export` (Note [model config] in
checkpoint/write/save.py), and the one shared directory a save needs (Note [one shared directory])."""

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
    from shardwise.checkpoint.format.schema import read_index
    from shardwise.models.zoo import build

    model = _llama() if hf else build("reused_block")
    sw.save(tmp_path / "ckpt", model)
    recorded = read_index(tmp_path / "ckpt").model_config
    assert (recorded is not None) == hf
    if hf:
        assert recorded["model_type"] == "llama" and recorded["hidden_size"] == 16


class _Wrapper(torch.nn.Module):
    """A user's wrapper that exposes its Hugging Face model's config, as training scripts often do."""

    def __init__(self, net):
        super().__init__()
        self.net, self.config = net, net.config

    def forward(self, x):
        return self.net(x)


def _wrapped(kind: str):
    if kind == "wrapper":
        return _Wrapper(_llama())
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.0))


@pytest.mark.parametrize("kind", ["wrapper", "peft"])
def test_a_model_holding_a_hugging_face_model_exports_no_config(tmp_path, capsys, kind):
    """Catches an export that from_pretrained loads as a random model: a PeftModel or a wrapper with
    `self.config = hf_model.config` recorded its config, the export wrote config.json beside tensors named
    `base_model.model.model...` / `net.model...`, from_pretrained loaded 0 of them, and the CLI said it
    "wrote config.json". Neither the checkpoint nor sw.export writes a config for them, and both say why."""
    from shardwise.checkpoint.format.schema import read_index

    model = _wrapped(kind)
    sw.save(tmp_path / "ckpt", model)
    assert read_index(tmp_path / "ckpt").model_config is None
    out = tmp_path / "export" / "model.safetensors"
    assert cli.main(["ckpt", "export", str(tmp_path / "ckpt"), str(out), "--mkdir"]) == 0
    said = capsys.readouterr().out
    assert "no config.json" in said and "wrote" not in said.split("\n", 2)[-1], said
    assert not (out.parent / "config.json").exists()
    with pytest.warns(UserWarning, match="no config.json written"):
        sw.export(model, tmp_path / "direct" / "model.safetensors")
    assert not (tmp_path / "direct" / "config.json").exists()
    if kind == "wrapper":  # a PeftModel's save_pretrained writes its adapters, as PEFT does
        with pytest.raises(sw.ShardwiseError, match="Save the Hugging Face model itself"):
            sw.save_pretrained(model, tmp_path / "pretrained")


def test_a_compiled_hugging_face_model_still_records_its_config(tmp_path):
    """Catches the rule above dropping the config of a model whose names only gain `_orig_mod.`."""
    from shardwise.checkpoint.format.schema import read_index

    sw.save(tmp_path / "ckpt", torch.compile(_llama()))
    assert read_index(tmp_path / "ckpt").model_config["model_type"] == "llama"


@pytest.mark.parametrize("field,value,message", [("num_hidden_layers", 3, "says the model has 3 layers"),
                                                 ("hidden_size", 32, "says the hidden size is 32")])
def test_an_edited_config_is_checked_against_the_tensors(tmp_path, capsys, field, value, message):
    """Catches a config edited in the index (3 layers where 2 are stored) exported without complaint:
    from_pretrained built 3 layers, one of them random. The export refuses and writes nothing."""
    from helpers.damage import edit_index

    sw.save(tmp_path / "ckpt", _llama())
    edit_index(tmp_path / "ckpt", lambda index: index["model_config"].update({field: value}))
    out = tmp_path / "export" / "model.safetensors"
    assert cli.main(["ckpt", "export", str(tmp_path / "ckpt"), str(out), "--mkdir"]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not (out.parent / "config.json").exists()
    model = _llama()
    model.config.num_hidden_layers = 3
    with pytest.raises(sw.ShardwiseError, match="says the model has 3 layers"):
        sw.export(model, tmp_path / "direct" / "model.safetensors")
    assert not (tmp_path / "direct" / "model.safetensors").exists()


def test_code_references_are_left_out_of_the_exported_config(tmp_path, capsys):
    """Catches a crafted `auto_map` (and `custom_pipelines`, at any depth) written into config.json as-is:
    with trust_remote_code=True, from_pretrained fetches and runs the named repository's code."""
    import json

    from helpers.damage import edit_index

    sw.save(tmp_path / "ckpt", _llama())
    code = {"AutoModelForCausalLM": "attacker/repo--modeling.Evil"}
    edit_index(tmp_path / "ckpt", lambda index: index["model_config"].update(
        auto_map=code, custom_pipelines={"x": {"impl": "evil.Pipe"}}, rope_scaling={"auto_map": code}))
    out = tmp_path / "export" / "model.safetensors"
    assert cli.main(["ckpt", "export", str(tmp_path / "ckpt"), str(out), "--mkdir"]) == 0
    said = capsys.readouterr().out
    assert "left out of it: auto_map, custom_pipelines, rope_scaling.auto_map" in said, said
    written = (out.parent / "config.json").read_text()
    assert "auto_map" not in written and "custom_pipelines" not in written
    assert json.loads(written)["model_type"] == "llama"


def test_export_does_not_replace_another_config_json(tmp_path, capsys):
    """Catches an export into a folder that already holds the user's own config.json replacing it
    (exporting `dir/extra.safetensors`). One that agrees (save_pretrained's, non-default values only,
    `architectures` filled in) is fine; a different one needs --replace-config / replace_config=True."""
    import json

    model = _llama()
    sw.save(tmp_path / "ckpt", model)
    folder = tmp_path / "dir"
    folder.mkdir()
    model.save_pretrained(folder)  # the same model's (architectures filled in after the save recorded none): agrees
    assert cli.main(["ckpt", "export", str(tmp_path / "ckpt"), str(folder / "model.safetensors")]) == 0
    theirs = {"model_type": "bert", "hidden_size": 768}
    (folder / "config.json").write_text(json.dumps(theirs))
    command = ["ckpt", "export", str(tmp_path / "ckpt"), str(folder / "extra.safetensors")]
    capsys.readouterr()
    assert cli.main(command) == 2
    assert "already exists and says another model (hidden_size, model_type differ)" in capsys.readouterr().err
    assert json.loads((folder / "config.json").read_text()) == theirs and not (folder / "extra.safetensors").exists()
    with pytest.raises(sw.ShardwiseError, match="replace_config=True"):
        sw.export(model, folder / "extra.safetensors")
    assert json.loads((folder / "config.json").read_text()) == theirs
    assert cli.main([*command, "--replace-config"]) == 0
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"


def _gpt2():
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))


@pytest.mark.parametrize("build", [_llama, _gpt2])
def test_an_untied_config_on_tied_tensors_is_refused(tmp_path, capsys, build):
    """Catches an export that stores a tied head once (under the embedding's name) beside a config saying
    tie_word_embeddings=False: from_pretrained then built a fresh random lm_head (logits 0.6 apart) and
    nothing said so. sw.export and `shardwise ckpt export` refuse, naming the fix, and write nothing;
    duplicate_tied=True writes both tensors, and from_pretrained then holds the trained head."""
    import transformers

    model = build()
    model.config.tie_word_embeddings = False  # the tensors stay tied
    with pytest.raises(sw.ShardwiseError, match="tie_word_embeddings=False.*duplicate_tied=True"):
        sw.export(model, tmp_path / "direct" / "model.safetensors")
    assert not (tmp_path / "direct").exists() or not any((tmp_path / "direct").iterdir())
    sw.save(tmp_path / "ckpt", model)
    out = tmp_path / "export" / "model.safetensors"
    assert cli.main(["ckpt", "export", str(tmp_path / "ckpt"), str(out), "--mkdir"]) == 2
    assert "tie_word_embeddings=False" in capsys.readouterr().err
    assert not out.exists() and not (out.parent / "config.json").exists()
    sw.export(model, tmp_path / "both" / "model.safetensors", duplicate_tied=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "both")
    assert torch.equal(loaded.get_output_embeddings().weight, model.get_input_embeddings().weight)


@pytest.mark.parametrize("build,field,value,message", [
    (_llama, "vocab_size", 65, "says vocab_size=65"),
    (_gpt2, "vocab_size", 63, "says vocab_size=63"),
    (_gpt2, "n_positions", 32, "says n_positions=32")])
def test_a_vocabulary_or_positions_the_tensors_contradict_are_refused_at_export(tmp_path, capsys, build, field,
                                                                                 value, message):
    """Catches a config whose vocab_size or n_positions disagrees with the tensors exported without a word
    (from_pretrained then failed on the shapes, or built another vocabulary): sw.export and `shardwise ckpt
    export` refuse at export, naming the field, and write nothing."""
    model = build()
    setattr(model.config, field, value)
    with pytest.raises(sw.ShardwiseError, match=message):
        sw.export(model, tmp_path / "direct" / "model.safetensors")
    assert not (tmp_path / "direct" / "model.safetensors").exists()
    sw.save(tmp_path / "ckpt", model)
    out = tmp_path / "export" / "model.safetensors"
    assert cli.main(["ckpt", "export", str(tmp_path / "ckpt"), str(out), "--mkdir"]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not (out.parent / "config.json").exists()

"""Hugging Face pretrained weights straight into shards (issue 59): `sw.load` of a model directory written by
`save_pretrained` in several files, against what `from_pretrained` gives in one process (Note [Hugging Face
directories] in checkpoint/read/hf_dir.py). Nothing is downloaded: the "pretrained" models are built here from
configs (tests/helpers/hf_dirs.py)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import shardwise as sw
from helpers.hf_dirs import (
    CONFIGS,
    VOCAB,
    build_sharded,
    config,
    index_of,
    load_and_compare,
    model_class,
    reference,
    rewrite_file,
    rows_of,
    tokens,
    write_pretrained,
)

pytest.importorskip("transformers")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """{(model name, dtype name): directory}, written once for the module."""
    root = tmp_path_factory.mktemp("pretrained")
    return {(name, d): write_pretrained(name, root / f"{name}-{d}", dtype) for name in CONFIGS
            for d, dtype in DTYPES.items()}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pretrained_dir_into_shards_equals_from_pretrained(ranks, pretrained, name, strategy, dtype):
    """Catches a Hugging Face directory refused or read wrong into a sharded model: another file's tensor or
    another rank's rows, a tied head (qwen2, gpt2: stored once) left at its init, the base-model prefix
    not matched, a bf16 file converted other than from_pretrained(dtype=float32) converts it; the logits
    on a batch must be from_pretrained's exactly."""
    directory = pretrained[(name, dtype)]
    expected = reference(name, directory, tokens())[0]
    for rank, differ, ok, notes in ranks.run(load_and_compare, 2, name, directory, strategy, expected, timeout=180):
        assert ok and differ == [], (rank, differ)
        assert any("carry no checksum" in n for n in notes)
        assert any("bfloat16 were converted to the model's torch.float32 (exactly)" in n for n in notes) == \
            (dtype == "bf16"), notes


def test_pretrained_index_path_into_hybrid_shards(ranks, pretrained):
    """Catches `sw.load(DIR/model.safetensors.index.json, model)` falling through to torch.load (whose error
    advised weights_only=False), and rows read by the flat rank instead of the shard coordinate under a
    2x2 (replicate, shard) mesh."""
    directory = pretrained[("qwen2", "bf16")]
    expected = reference("qwen2", directory, tokens())[0]
    for rank, differ, ok, _ in ranks.run(load_and_compare, 4, "qwen2", directory, "zero3", expected, (2, 2),
                                         directory / "model.safetensors.index.json", timeout=240):
        assert ok and differ == [], (rank, differ)


def _from_pretrained(name, directory, auto, expected):
    import torch.distributed as dist
    import transformers

    model_class_ = transformers.AutoModelForCausalLM if auto else model_class(name)
    model, report = sw.from_pretrained(model_class_, directory, strategy="zero3", output_loading_info=True)
    differ = [n for n, info in sw.shard_info(model).items()
              if not torch.equal(info.rows.reshape(-1), rows_of(info, expected[n]).reshape(-1))]
    dtypes = {p.dtype for p in model.parameters()}
    logits = reference(name, directory, tokens())[1]
    with torch.no_grad():
        if model.training or not torch.equal(model(input_ids=tokens()).logits, logits):
            differ.append("logits")
    return dist.get_rank(), differ, report.ok, dtypes


@pytest.mark.parametrize("auto", [False, True], ids=["class", "auto"])
def test_from_pretrained_builds_straight_into_shards(ranks, pretrained, auto):
    """Catches sw.from_pretrained building the model whole, in the config's bf16 instead of fp32 masters, from an
    Auto class it cannot build, or returned in train mode (dropout on: transformers returns eval mode)."""
    directory = pretrained[("gpt2", "bf16")]
    expected = reference("gpt2", directory, tokens())[0]
    for rank, differ, ok, dtypes in ranks.run(_from_pretrained, 2, "gpt2", directory, auto, expected, timeout=180):
        assert ok and differ == [] and dtypes == {torch.float32}, (rank, differ, dtypes)


def test_base_model_prefix_and_legacy_names(tmp_path):
    """Catches transformers' own names left unmatched: a base `LlamaModel`'s file (no `model.` prefix) into a
    `LlamaForCausalLM` and the reverse, the hub GPT-2's layout (no `transformer.` prefix, the old `attn.bias`
    masks, which transformers ignores), and BERT's legacy `LayerNorm.gamma`/`beta` (which it renames)."""
    import transformers

    torch.manual_seed(0)
    base = transformers.LlamaModel(config("llama"))
    base.save_pretrained(tmp_path / "base", max_shard_size="12KB")
    causal = model_class("llama")(config("llama"))
    report = sw.load(tmp_path / "base", causal, strict=False)
    assert report.missing == ["lm_head.weight"] and not report.unexpected, report
    assert torch.equal(causal.model.layers[1].mlp.up_proj.weight, base.layers[1].mlp.up_proj.weight)
    causal.save_pretrained(tmp_path / "causal", max_shard_size="12KB")
    again = transformers.LlamaModel(config("llama"))
    report = sw.load(tmp_path / "causal", again, strict=False)
    assert report.unexpected == ["lm_head.weight"] and not report.missing, report

    from safetensors.torch import save_file

    torch.manual_seed(1)
    gpt2 = model_class("gpt2")(config("gpt2"))
    old = {k.removeprefix("transformer."): v.clone() for k, v in gpt2.state_dict().items() if k != "lm_head.weight"}
    old["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)  # as the hub's gpt2 stores it: no prefix, the old mask
    (tmp_path / "old").mkdir()
    save_file(old, tmp_path / "old" / "model.safetensors", metadata={"format": "pt"})
    for path in (tmp_path / "old", tmp_path / "old" / "model.safetensors"):  # the directory, or its one file
        fresh = model_class("gpt2")(config("gpt2"))
        report = sw.load(path, fresh)
        assert report.ok and any("transformers ignores" in n for n in report.notes), report
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), gpt2.state_dict().values()))

    bert_config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=4, intermediate_size=64, max_position_embeddings=32)
    bert = transformers.BertForMaskedLM(bert_config)
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v.clone()
              for k, v in bert.state_dict().items() if "decoder" not in k}
    assert sum(".gamma" in k for k in legacy) >= 3
    (tmp_path / "legacy").mkdir()
    save_file(legacy, tmp_path / "legacy" / "model.safetensors", metadata={"format": "pt"})
    bert_config.save_pretrained(tmp_path / "legacy")
    expected = transformers.BertForMaskedLM.from_pretrained(tmp_path / "legacy").state_dict()
    fresh = transformers.BertForMaskedLM(bert_config)
    assert sw.load(tmp_path / "legacy", fresh).ok
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())


def _refused(name, path, strategy, changes):
    """Load `path` into a sharded model; return the error and whether every row stayed as it was."""
    import torch.distributed as dist

    model = build_sharded(name, strategy, **changes)
    before = {n: info.rows.clone() for n, info in sw.shard_info(model).items()}
    try:
        sw.load(path, model)
        message = None
    except sw.ShardwiseError as error:
        message = str(error)
    unchanged = all(torch.equal(info.rows, before[n]) for n, info in sw.shard_info(model).items())
    return dist.get_rank(), message, unchanged


def _damage(kind, directory):
    index = index_of(directory)
    files = sorted(set(index["weight_map"].values()))
    key = next(k for k in index["weight_map"] if "layers.1" in k and k.endswith("up_proj.weight"))
    if kind == "missing file":
        (directory / files[1]).unlink()
    elif kind == "index names absent file":
        index["weight_map"][key] = "model-00099-of-00099.safetensors"
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    elif kind == "damaged index":
        text = (directory / "model.safetensors.index.json").read_text()
        (directory / "model.safetensors.index.json").write_text(text[: len(text) // 2])
    elif kind == "index disagrees":
        other = next(f for f in files if f != index["weight_map"][key])
        index["weight_map"][key] = other
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    elif kind == "missing tensor":
        rewrite_file(directory, key, lambda tensors: tensors.pop(key))
    elif kind == "extra tensor":
        rewrite_file(directory, key, lambda tensors: tensors.update({"model.layers.1.extra.weight": torch.ones(4)}))
    elif kind == "misshaped tensor":
        rewrite_file(directory, key, lambda tensors: tensors.update({key: tensors[key][:, :-1].contiguous()}))
    elif kind == "truncated file":
        with open(directory / files[-1], "r+b") as f:
            f.truncate(f.seek(0, 2) - 8)


_EXPECTED = {
    "missing file": "is not in",
    "index names absent file": "model-00099-of-00099.safetensors, which is not in",
    "damaged index": "is damaged",
    "index disagrees": "files that do not hold them",
    "missing tensor": "missing from the checkpoint",
    "extra tensor": "unexpected in the checkpoint",
    "misshaped tensor": "shape mismatch",
    "truncated file": "truncated",
}


@pytest.mark.parametrize("kind", sorted(_EXPECTED))
def test_bad_pretrained_dir_refused_on_every_rank_before_any_change(ranks, pretrained, tmp_path, kind):
    """Catches a damaged or incomplete Hugging Face directory loaded in part, or refused on one rank while the
    other waits: a shard file missing, an index naming a file not there or placing a tensor in the wrong
    file, a half-written index, a tensor missing, extra or of another shape, a truncated file. Each is a
    ShardwiseError naming the fault on both ranks, every row as it was."""
    directory = shutil.copytree(pretrained[("llama", "bf16")], tmp_path / "llama")
    _damage(kind, directory)
    for rank, message, unchanged in ranks.run(_refused, 2, "llama", directory, "zero3", {}, timeout=180):
        assert message is not None and _EXPECTED[kind] in message, (rank, message)
        assert unchanged, rank
        assert "weights_only=False" not in message


def test_model_of_other_shape_refused(ranks, pretrained):
    """Catches a pretrained tensor whose shape disagrees with the model's (another intermediate size) loaded in
    part: refused on every rank with the names and both shapes, every row as it was."""
    directory = pretrained[("llama", "fp32")]
    for rank, message, unchanged in ranks.run(_refused, 2, "llama", directory, "zero2",
                                              {"intermediate_size": 48}, timeout=180):
        assert message is not None and "shape mismatch" in message and "[64, 32]" in message, (rank, message)
        assert unchanged, rank


def test_torch_error_never_advises_unsafe_load(tmp_path):
    """Catches torch.load's advice to pass weights_only=False (which runs whatever code a file holds) passed on
    to the user, and a JSON file read as if it were weights."""
    import argparse

    torch.save({"weight": torch.ones(2, 2), "args": argparse.Namespace(lr=1.0)}, tmp_path / "pickled.bin")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(sw.ShardwiseError) as error:
        sw.load(tmp_path / "pickled.bin", model)
    assert "weights_only=False" not in str(error.value) and "weights_only=True" in str(error.value)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(sw.ShardwiseError, match="JSON file, not weights"):
        sw.load(tmp_path / "config.json", model)


def _fine_tune_and_export(name, directory, out, strategy, max_shard_size):
    """Load the pretrained directory into shards, take two AdamW steps, export; the trained full values."""
    model = sw.from_pretrained(model_class(name), directory, strategy=strategy).train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = tokens()
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
    sw.save_pretrained(model, out, max_shard_size=max_shard_size)
    return sw.full_state_dict(model)


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_fine_tuned_shards_export_to_what_from_pretrained_loads(ranks, pretrained, tmp_path, name):
    """Catches sw.save_pretrained of a sharded, fine-tuned model that from_pretrained cannot load or loads other
    values: all in one file past the size asked for, an index naming the wrong file for a tensor or missing
    one, a tied head (qwen2) stored twice or not re-tied, another rank's rows; and a second export into the
    same directory mixing its files with the first's (a stale index beside a new single file)."""
    import transformers

    out = tmp_path / "fine-tuned"
    trained = ranks.run(_fine_tune_and_export, 2, name, pretrained[(name, "bf16")], out, "zero3", "12KB",
                        timeout=240)[0]
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) >= 3 and (out / "model.safetensors.index.json").exists() and (out / "config.json").exists()
    assert set(index_of(out)["weight_map"].values()) == set(files)
    loaded = model_class(name).from_pretrained(out)
    assert loaded.dtype == torch.float32 and set(loaded.state_dict()) == set(trained)
    differ = [k for k, v in loaded.state_dict().items() if not torch.equal(v, trained[k])]
    assert differ == [], differ
    before = {k: v.clone() for k, v in loaded.state_dict().items()}
    assert not torch.equal(before["model.norm.weight"], reference(name, pretrained[(name, "bf16")], tokens())[0][
        "model.norm.weight"]), "the steps changed nothing: the test cannot tell trained from pretrained"

    ranks.run(_fine_tune_and_export, 2, name, pretrained[(name, "bf16")], out, "zero2", "50GB", timeout=240)
    assert sorted(p.name for p in out.glob("*.safetensors*")) == ["model.safetensors"]
    assert isinstance(transformers.AutoModelForCausalLM.from_pretrained(out), model_class(name))


def test_max_shard_size_is_checked():
    """Catches a max_shard_size that is not a size (0, "5 apples") taken for one: every tensor in a file of its
    own, or a TypeError deep in the writer."""
    from shardwise.checkpoint.interop.hf_save import size_in_bytes

    assert size_in_bytes("5GB") == 5 * 10**9 and size_in_bytes("2MiB") == 2 * 2**20 and size_in_bytes(123) == 123
    for bad in (0, -1, "5 apples", "GB", True):
        with pytest.raises(sw.ShardwiseError, match="max_shard_size"):
            size_in_bytes(bad)


def test_deferred_model_not_sharded_is_refused(pretrained):
    """Catches sw.load into a model built under sw.deferred_init() and never sharded: its parameters on the
    meta device took no values, and the load reported every tensor loaded."""
    with sw.deferred_init():
        model = model_class("qwen2")(config("qwen2"))
    with pytest.raises(sw.ShardwiseError, match="meta device.*sw.shard"):
        sw.load(pretrained[("qwen2", "fp32")], model)


def _bytes_read(name, directory, strategy):
    """The bytes this rank's load read from the weights files' data (pread), and its shards' bytes in them."""
    import os

    import torch.distributed as dist

    from shardwise.checkpoint.read import reader

    model = build_sharded(name, strategy)
    counted = []
    real = os.preadv

    def preadv(fd, buffers, offset):
        done = real(fd, buffers, offset)
        counted.append(done)
        return done

    reader.os.preadv = preadv
    try:
        sw.load(directory, model)
    finally:
        reader.os.preadv = real
    infos = sw.shard_info(model).values()
    mine = sum((info.row_end - info.row_start) * math.prod(info.full_shape[1:]) for info in infos)
    return dist.get_rank(), sum(counted), mine * 2  # bf16 files


def test_each_rank_reads_only_itsrows_of(ranks, pretrained):
    """Catches a rank reading whole tensors (the model, not its shards) from a Hugging Face directory: under zero3
    at 2 ranks, each rank's reads of the files' data are its own rows' bytes, and together every byte once."""
    directory = pretrained[("qwen2", "bf16")]
    total = sum(v.numel() for k, v in reference("qwen2", directory, tokens())[0].items() if k != "lm_head.weight") * 2
    results = ranks.run(_bytes_read, 2, "qwen2", directory, "zero3", timeout=180)
    for rank, read, mine in results:
        assert read == mine and read < 0.6 * total, (rank, read, mine, total)
    assert sum(read for _, read, _ in results) == total

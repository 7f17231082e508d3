"""One grammar on the command line: MODEL [KEY=VALUE ...] for estimate, plan and units; every bad
name or path a one-line error with the fix; MiB everywhere; checkpoints paths said as they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise import cli

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["--memory", "1GiB", "--world-size", "2"]
TINY_LLAMA = ["llama", "hidden_size=64", "num_hidden_layers=2", "intermediate_size=128", "num_attention_heads=4",
              "num_key_value_heads=4", "vocab_size=256"]


def test_a_hugging_face_model_type_with_sizes_is_a_model(capsys):
    """Catches `shardwise units llama hidden_size=...` listing only the zoo: a Hugging Face model type
    with its config's sizes names a model in every command, built on meta."""
    assert cli.main(["units", *TINY_LLAMA]) == 0
    out = capsys.readouterr().out
    assert "LlamaDecoderLayer" in out and "model.layers.1" in out
    assert cli.main(["estimate", *TINY_LLAMA, "--world-size", "2"]) == 0
    assert "zero3: 0.1M parameters, world size 2" in capsys.readouterr().out
    assert cli.main(["plan", *TINY_LLAMA, *PLAN]) == 0
    assert "`shardwise units llama hidden_size=64" in capsys.readouterr().out


def test_estimate_takes_model_positionally_like_plan_and_units(capsys):
    """Catches `estimate` alone needing --model: MODEL is positional everywhere (zoo gpt with sizes
    as KEY=VALUE too), and the older --model still works."""
    assert cli.main(["estimate", "gpt", "d_model=64", "n_layers=2", "--world-size", "2"]) == 0
    positional = capsys.readouterr().out
    assert cli.main(["estimate", "--model", "gpt:d_model=64,n_layers=2", "--world-size", "2"]) == 0
    assert capsys.readouterr().out == positional


def test_estimating_a_hugging_face_type_prints_no_transformers_warning():
    """Catches `shardwise estimate gpt2 ... --batch` printing transformers' `loss_type=None` warning
    (GPT-2's class name names no loss; the probe's forward computes one). A fresh process: the
    warning is printed once per process."""
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "estimate", "gpt2", "n_layer=1", "n_embd=32",
                           "n_head=2", "vocab_size=64", "--batch", "1", "--seq", "8"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "loss_type" not in done.stdout + done.stderr, done.stderr


def test_the_gather_row_is_explained(capsys):
    """Catches the gather/reduce buffers row changing with --batch and nothing saying why."""
    assert cli.main(["estimate", "gpt", "--world-size", "2"]) == 0
    without = capsys.readouterr().out
    assert "note: gather/reduce buffers: lent by the engine's comm pool in backward" in without
    assert "with batch= the probe counts those gradients among the activations" in without


def user_files(tmp_path: Path) -> None:
    (tmp_path / "raises_on_import.py").write_text("import torch\nraise RuntimeError('no GPU here')\n")
    (tmp_path / "raises_on_call.py").write_text("def build():\n    raise ValueError('bad size')\n")
    (tmp_path / "no_build.py").write_text("def model():\n    pass\n")


BAD = [
    (["./nope.py:build"], "./nope.py: no such file"),
    (["nope.py"], "MODEL nope.py: no such file"),
    (["lama"], "did you mean 'llama'?"),
    (["no_such_module:build"], "cannot import 'no_such_module'"),
    (["raises_on_import:build"], "importing raises_on_import raised RuntimeError: no GPU here"),
    (["raises_on_call.py:build"], "raises_on_call.py:build() raised ValueError: bad size"),
    (["no_build.py"], "no_build.py has no function 'build'"),
    (["llama", "hiden_size=64"], "(did you mean hidden_size?)"),
    (["llama", "hidden_size=100", "num_attention_heads=3"], "not a multiple of the number of attention heads"),
    (["llama", "hidden_size"], "'hidden_size' is not KEY=VALUE"),
    (["reused_block", "d_model=3"], "takes no KEY=VALUE"),
    (["."], "no config.json there"),
]


@pytest.mark.parametrize("command", ["units", "estimate", "plan"])
@pytest.mark.parametrize("words,message", BAD, ids=[" ".join(w) for w, _ in BAD])
def test_a_bad_model_is_one_line_with_the_fix(command, words, message, tmp_path, monkeypatch, capsys):
    """Catches a bad MODEL (missing file, module raising, unknown name or config field) ending in a
    Python traceback or a message that does not say what to write instead."""
    user_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert cli.main([command, *words, *(PLAN if command == "plan" else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardwise {command}: ") and message in err, err
    assert "\n" not in err, err


def test_a_missing_model_file_prints_no_traceback():
    """Catches `shardwise units ./nope.py:build` printing a Python traceback (as the console script runs)."""
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "units", "./nope.py:build"],
                          capture_output=True, text=True, cwd=ROOT / "tests")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr


def test_model_is_required_with_an_example(capsys):
    """Catches `shardwise estimate` with no MODEL failing without saying how to name one."""
    assert cli.main(["estimate"]) == 2
    assert "shardwise estimate MODEL [KEY=VALUE ...]" in capsys.readouterr().err


def test_ckpt_paths_are_said_as_they_are(tmp_path, capsys):
    """Catches `ckpt inspect` calling a path that does not exist "not a shardwise checkpoint",
    `ckpt export` creating a missing directory silently, and inspect printing MB where every
    other command prints MiB."""
    model = torch.nn.Linear(64, 64)
    sw.save(tmp_path / "ck", model)
    assert cli.main(["ckpt", "inspect", str(tmp_path / "no" / "such")]) == 2
    assert "no/such does not exist" in capsys.readouterr().err
    assert cli.main(["ckpt", "inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert " MiB" in out and " MB" not in out, out

    out_file = tmp_path / "new" / "dir" / "m.safetensors"
    assert cli.main(["ckpt", "export", str(tmp_path / "ck"), str(out_file)]) == 2
    assert "does not exist: create it, or pass --mkdir" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    assert cli.main(["ckpt", "export", str(tmp_path / "ck"), str(out_file), "--mkdir"]) == 0
    assert f"created {out_file.parent}/" in capsys.readouterr().out and out_file.is_file()


def test_strategy_names_get_did_you_mean():
    """Catches a mistyped strategy (`zero4`) answered without the likely one."""
    with pytest.raises(sw.ShardwiseError, match="did you mean 'zero3'"):
        sw.ShardConfig.of("zero4")


def test_sharding_twice_the_same_way_does_not_talk_of_changing_strategy():
    """Catches `sw.shard` called twice with the same strategy answered "to change strategy"."""
    sw.init()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        sw.shard(model, strategy="zero2", units=["0", "1"])
        with pytest.raises(sw.ShardwiseError, match="once per model") as raised:
            sw.shard(model, strategy="zero2", units=["0", "1"])
        assert "change strategy" not in str(raised.value)
        with pytest.raises(sw.ShardwiseError, match="to change strategy"):
            sw.shard(model, strategy="zero3")
    finally:
        sw.shutdown()

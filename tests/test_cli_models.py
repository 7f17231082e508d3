"""The estimator's commands with your own model: module:function from the current directory,
--units, the full sw.shard(...) advice, close budgets, and `ckpt export` into a new folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from shardwise import cli

MODEL = textwrap.dedent("""
    import torch
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(512, 512)
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = torch.nn.Sequential(*[Block() for _ in range(8)])
            self.head = torch.nn.Linear(512, 10)
    def build():
        return Net()
""")


def test_module_function_imports_from_the_current_directory(tmp_path, monkeypatch, capsys):
    """Catches a raw ModuleNotFoundError for a model file next to the user (it needed PYTHONPATH=.)."""
    (tmp_path / "my_net.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".")])
    assert cli.main(["estimate", "--model", "my_net:build", "--world-size", "4"]) == 0
    assert "activations not counted" in capsys.readouterr().out  # 0.0 with no caveat before
    assert cli.main(["estimate", "--model", "not_there:build"]) == 2
    assert "cannot import 'not_there'" in capsys.readouterr().err


def test_plan_prints_the_whole_shard_call_with_units(tmp_path, monkeypatch, capsys):
    """Catches advice without units= (the plan it priced cut the model differently) and a
    --units the estimate ignores."""
    (tmp_path / "my_net2.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "my_net2:build", "--memory", "4GiB", "--world-size", "2", "--units", "Block"]) == 0
    out = capsys.readouterr().out
    assert 'use: sw.shard(model, strategy="ddp", precision="fp32", units=Block)' in out, out
    assert cli.main(["plan", "my_net2:build", "--memory", "4GiB", "--world-size", "2",
                     "--units", "stack.0,stack.1"]) == 0
    assert "units=['stack.0', 'stack.1']" in capsys.readouterr().out


def test_a_close_budget_says_by_how_much():
    """Catches '1.00 GiB > 1.00 GiB by 0.00 GiB': a difference hidden by the rounding."""
    from dataclasses import replace

    from shardwise.estimate.core import estimate
    from shardwise.estimate.plan import _why_not

    est = estimate(10**6, "ddp", 1)
    est = replace(est, runtime=est.runtime + 2**30 + 4 * 2**20 - est.total)  # a total of 1 GiB + 4 MiB
    text = _why_not(est, 2**30, checkpointing=False)
    assert text.startswith("1,028.0 MiB > 1,024.0 MiB by 4.0 MiB"), text


def test_ckpt_export_into_a_new_folder(tmp_path):
    """Catches a raw FileNotFoundError traceback when OUT's folder does not exist yet (with --mkdir:
    it is created, and the output says so)."""
    import shardwise as sw
    from shardwise.models.zoo import build

    sw.init()
    try:
        sw.save(tmp_path / "ckpt", build("reused_block"))
    finally:
        sw.shutdown()
    out = tmp_path / "new" / "folder" / "model.safetensors"
    assert cli.main(["ckpt", "export", str(tmp_path / "ckpt"), str(out), "--mkdir"]) == 0
    assert out.is_file()


INPUTS = MODEL + textwrap.dedent("""
    def forward(self, x):
        for block in self.stack:
            x = torch.relu(block.fc(x))
        return self.head(x)
    Net.forward = forward
    def inputs(batch, seq, device):
        return torch.ones(batch, 512, device=device)
    HELD = bytearray(64 * 2**20)  # 64 MiB that importing this module adds to a process
    HELD[::4096] = b"x" * len(HELD[::4096])
""")


def test_units_command_prints_the_unit_table(tmp_path, monkeypatch, capsys):
    """Catches `shardwise units` missing, or printing something other than sw.describe's plan
    (one row per unit, the root first, MiB per rank at --world-size)."""
    (tmp_path / "my_net3.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["units", "my_net3:build", "--units", "Block", "--world-size", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "world size 2" in lines[0] and lines[1].startswith("<root>")
    assert [line.split()[0] for line in lines[2:]] == [f"stack.{i}" for i in range(8)]
    assert all(line.split()[1] == "Block" for line in lines[2:])
    assert cli.main(["units", "not_there:build"]) == 2


def test_estimate_any_model_with_batch_inputs_and_its_imports(tmp_path, monkeypatch, capsys):
    """Catches --batch refused (or activations 0) for a user's model, --inputs ignored, and the
    runtime row leaving out what importing the model's module costs every rank (transformers:
    about 120 MiB; here a module holding 64 MiB). The measured run is a process of its own: the import's RSS
    is measured process-wide, and in the pytest worker another test's leftover thread freeing memory at that
    moment once hid all of it (a fresh clone's make test: runtime - RUNTIME_BYTES == 0)."""
    (tmp_path / "my_net4.py").write_text(INPUTS)
    monkeypatch.chdir(tmp_path)
    args = ["estimate", "--model", "my_net4:build", "--world-size", "2", "--json"]
    main = "import sys; from shardwise import cli; sys.exit(cli.main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", main, *args, "--batch", "8", "--inputs", "my_net4:inputs"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    est = json.loads(done.stdout)
    assert cli.main(args + ["--batch", "8"]) == 2  # no way to build its inputs: says how
    assert "--inputs" in capsys.readouterr().err
    from shardwise.estimate.core import RUNTIME_BYTES

    assert est["activations"] > 8 * 512 * 4 * 8  # eight blocks' outputs of 8 x 512 floats at least
    assert est["runtime"] >= RUNTIME_BYTES + 60 * 2**20, est["runtime"] - RUNTIME_BYTES
    assert est["total"] >= est["runtime"] + est["activations"]


def test_plan_says_which_units_auto_makes(tmp_path, monkeypatch, capsys):
    """Catches advice that leaves units out when they are "auto": the call printed must be the
    whole call, and say what "auto" cut."""
    (tmp_path / "my_net5.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "my_net5:build", "--memory", "4GiB", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert 'precision="fp32", units="auto")' in out, out
    assert "units: 8 x Block + the root" in out, out

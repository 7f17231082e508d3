"""Hostile and damaged checkpoints: nothing runs, every byte is checked, a refused load changes
nothing, and every refusal is a ShardwiseError naming the file and the field."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.checkpoint import tools
from shardwise.models.zoo import build


class _Payload:
    """Unpickling it creates `marker`: the proof that a load ran code from the checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _plant_pickle(directory: Path, name: str, marker: Path) -> None:
    with open(directory / name, "wb") as f:
        pickle.dump({"epoch": 0, "payload": _Payload(marker)}, f)


def test_lightning_state_runs_no_code(tmp_path):
    """Catches ShardwiseStrategy.load_checkpoint unpickling `lightning.pt` (weights_only=False): a
    crafted file inside a checkpoint directory ran its payload. Lightning's state is JSON in the
    index now; a legacy lightning.pt is read with the caller's weights_only (True by default)."""
    pytest.importorskip("lightning")
    from shardwise.integrations.lightning import ShardwiseStrategy

    marker = tmp_path / "ran"
    sw.save(tmp_path / "ckpt", build("gpt"))
    _plant_pickle(tmp_path / "ckpt", "lightning.pt", marker)
    strategy = ShardwiseStrategy()
    for weights_only in (None, True):
        with pytest.raises(sw.ShardwiseError, match="lightning.pt could not be read"):
            strategy.load_checkpoint(tmp_path / "ckpt", weights_only=weights_only)
    assert not marker.exists()
    sw.save(tmp_path / "lit", build("gpt"), lightning={"epoch": 3, "loops": {"fit_loop": {"n": [1, 2]}},
                                                        "callbacks": {"best": {"__tensor__": 0.5, "dtype": "float32"}}})
    meta = strategy.load_checkpoint(tmp_path / "lit")
    assert meta["epoch"] == 3 and meta["loops"] == {"fit_loop": {"n": [1, 2]}}
    assert torch.equal(meta["callbacks"]["best"], torch.tensor(0.5))
    assert meta["_shardwise_path"] == str(tmp_path / "lit")


def test_inspect_flags_files_that_are_not_shardwise(tmp_path, capsys):
    """Catches `shardwise ckpt inspect` calling a directory with a planted pickle "intact"."""
    from shardwise.cli.main import main

    sw.save(tmp_path / "ckpt", build("gpt"))
    _plant_pickle(tmp_path / "ckpt", "lightning.pt", tmp_path / "ran")
    lines, ok = tools.inspect(tmp_path / "ckpt")
    assert not ok and any("lightning.pt" in line and "NOT SHARDWISE'S" in line for line in lines), lines
    assert main(["ckpt", "inspect", str(tmp_path / "ckpt")]) == 1
    assert "every file is intact" not in capsys.readouterr().out
    assert not (tmp_path / "ran").exists()

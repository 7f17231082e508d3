"""A small checkpoint with everything an index can hold, and ways to damage it as an unlucky
operator or an attacker would: an edited index (with or without a fresh digest), an edited
rank-file header, a flipped byte. Used by test_checkpoint_hostile.py and test_checkpoint_fuzz.py,
which take their checkpoint from the `small` fixture (registered for every test module by conftest.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise as sw

RANK_FILE = "rank-00000-of-00001.safetensors"


def digest(index: dict) -> str:
    """The index's own digest, computed here as the format defines it (sorted keys, no spaces)."""
    body = {k: v for k, v in index.items() if k != "digest"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def trained(seed: int = 0):
    """A tiny model, AdamW after one step, a scheduler and a sampler: every part of an index."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.BatchNorm1d(3))
    optim = torch.optim.AdamW(model.parameters(), lr=0.001 * (seed + 1), betas=(0.8, 0.9))
    scheduler = torch.optim.lr_scheduler.StepLR(optim, 2)
    sampler = sw.ResumableSampler(10, seed=3 + seed, rank=0, world_size=1)
    model(torch.randn(5, 4)).sum().backward()
    optim.step()
    scheduler.step()
    return model, optim, scheduler, sampler


def trained_several(seed: int = 0):
    """`trained`'s parts with two optimizers by name: Muon on the first matrix and torch's Adafactor,
    whose row and column factors are whole records (Note [optimizer records]), on the rest."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.BatchNorm1d(3))
    muon = torch.optim.Muon([model[0].weight], lr=0.01 * (seed + 1))
    factored = torch.optim.Adafactor([p for p in model.parameters() if p is not model[0].weight],
                                     lr=0.001 * (seed + 1))
    scheduler = torch.optim.lr_scheduler.StepLR(factored, 2)
    sampler = sw.ResumableSampler(10, seed=3 + seed, rank=0, world_size=1)
    model(torch.randn(5, 4)).sum().backward()
    muon.step()
    factored.step()
    scheduler.step()
    return model, {"muon": muon, "factored": factored}, scheduler, sampler


def optimizers_of(optim) -> dict:
    """The parts' optimizers by name ("" for a single one)."""
    return optim if isinstance(optim, dict) else {"": optim}


def save_small(path: Path, make=trained) -> Path:
    model, optim, scheduler, sampler = make()
    return sw.save(path, model, optim, scheduler, sampler=sampler, step=2)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A checkpoint of `trained()`: a tiny model with AdamW state, a scheduler, a sampler and `step=2`."""
    return save_small(tmp_path_factory.mktemp("small") / "ckpt")


@pytest.fixture(scope="module")
def several(tmp_path_factory) -> Path:
    """A checkpoint of `trained_several()`: two optimizers by name, whole records among their state."""
    return save_small(tmp_path_factory.mktemp("several") / "ckpt", trained_several)


def load_small(path: Path, parts=None):
    """Load `path` into `parts` (fresh ones by default); returns the parts."""
    parts = parts or trained(seed=1)
    model, optim, scheduler, sampler = parts
    sw.load(path, model, optim, scheduler, sampler=sampler)
    return parts


def snapshot(parts) -> dict:
    """Every value a load writes, copied (to compare before and after)."""
    model, optim, scheduler, sampler = parts
    out = {f"param:{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for label, one in optimizers_of(optim).items():
        for i, group in enumerate(one.param_groups):
            out.update({f"{label}group{i}:{k}": v for k, v in group.items() if k != "params"})
        for i, state in enumerate(one.state.values()):
            out.update({f"{label}state{i}:{k}": v.clone() if torch.is_tensor(v) else v for k, v in state.items()})
    out["scheduler"] = scheduler.state_dict()
    out["sampler"] = sampler.state_dict()
    return out


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if torch.is_tensor(x) or torch.is_tensor(y):
            if not (torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.view(-1).view(torch.uint8) if x.numel() else x,
                                    y.view(-1).view(torch.uint8) if y.numel() else y)):
                return False
        elif repr(x) != repr(y):
            return False
    return True


def copy(checkpoint: Path, to: Path) -> Path:
    shutil.copytree(checkpoint, to)
    return to


def edit_index(checkpoint: Path, change, *, redigest: bool = True) -> None:
    """Apply `change(index)` to index.json; with `redigest`, give it a matching digest (a forged
    or hand-edited index that is whole), else leave the old one (damage)."""
    index = json.loads((checkpoint / "index.json").read_text())
    change(index)
    if redigest:
        index["digest"] = digest(index)
    (checkpoint / "index.json").write_text(json.dumps(index))


def edit_header(file: Path, change) -> None:
    """Apply `change(header_bytes) -> bytes` to a safetensors file's header, padded back to a
    multiple of 8 bytes (its length prefix updated)."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = change(data[8 : 8 + length])
    header += b" " * (-len(header) % 8)
    file.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + length :])


def match_file_size(checkpoint: Path) -> None:
    """Give the rank file's index entry its current size, with a fresh digest: an edited header that
    changed the file's length then meets the header's own checks, not the size check before them."""
    size = (checkpoint / RANK_FILE).stat().st_size
    edit_index(checkpoint, lambda index: index["files"][RANK_FILE].update(bytes=size))


def header_of(file: Path) -> dict:
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])

"""Checks that cannot be sidestepped (issue 35): an RNG record cannot shadow a parameter's header
check, two source names that become one are an error, the apply phase re-checks what it reads, and
saved settings must fit the live value's type and range. Each refusal comes before anything is
written (Note [validate, then apply] in load.py)."""

from __future__ import annotations

import json
import math
import re

import pytest
import safetensors.torch
import torch
from torch import nn

import shardwise as sw
from helpers.damage import RANK_FILE, copy, edit_index, header_of, load_small, same, snapshot, trained
from shardwise.checkpoint.read.reader import file_digest


def _forge_rank_file(checkpoint, change_header) -> None:
    """Change the rank file's header bytes, then give the index the file's new size and digest: a
    forger's work, whole by every digest."""
    file = checkpoint / RANK_FILE
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = change_header(data[8 : 8 + length])
    header += b" " * (-len(header) % 8)
    file.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + length :])
    size, digest = file.stat().st_size, file_digest(file)
    edit_index(checkpoint, lambda index: index["files"][RANK_FILE].update(bytes=size, digest=digest))


def test_an_rng_record_cannot_shadow_a_parameters_header_check(small, tmp_path):
    """Catches an RNG record named like a parameter (`param/2.weight` under `rng`) turning off that
    parameter's header dtype check: a rank file whose header says I32 loaded as ok, its bits read as
    integers."""
    checkpoint = copy(small, tmp_path / "c")
    index = json.loads((checkpoint / "index.json").read_text())
    piece = index["params"]["2.weight"]["slices"][0]
    _forge_rank_file(checkpoint, lambda h: re.sub(rb'("param/2\.weight":\{"dtype":")F32', rb"\1I32", h))
    edit_index(checkpoint, lambda i: i["rng"][0]["tensors"].update(
        {"param/2.weight": {"chunk": piece["chunk"], "crcs": piece["crcs"]}}))
    parts = trained(seed=1)
    before = snapshot(parts)
    with pytest.raises(sw.ShardwiseError, match="RNG state's name"):
        load_small(checkpoint, parts)
    assert same(before, snapshot(parts))


@pytest.mark.parametrize("keys, rename", [(["weight", "module.weight"], None),
                                          (["enc.weight", "dec.weight"], [(r"^(enc|dec)\.", "")])],
                         ids=["prefix", "rename"])
def test_two_source_names_that_become_one_are_refused(tmp_path, keys, rename):
    """Catches two source names mapping to one model name (`weight` and `module.weight` once the wrapper
    prefix is dropped, or a rename that merges two): one was silently dropped, strict load said ok."""
    path = tmp_path / "two.safetensors"
    safetensors.torch.save_file({key: torch.full((2,), float(i)) for i, key in enumerate(keys)}, path)
    model = nn.Module()
    model.weight = nn.Parameter(torch.zeros(2))
    with pytest.raises(sw.ShardwiseError, match="both become 'weight'") as caught:
        sw.load(path, model, rename=rename)
    assert all(repr(key) in str(caught.value) for key in keys), caught.value
    torch.save({key: torch.full((2,), float(i)) for i, key in enumerate(keys)}, tmp_path / "two.pt")
    with pytest.raises(sw.ShardwiseError, match="both become"):
        sw.load(tmp_path / "two.pt", model, rename=rename)
    assert torch.equal(model.weight, torch.zeros(2))


def test_a_file_rewritten_between_verify_and_apply_is_refused(small, tmp_path, monkeypatch):
    """Catches the apply phase re-reading verified rows without their checksums, or copying them from the
    file's map without proving the file unchanged (issue 45): a rank file rewritten in place between the
    two phases (what `cp` over it does) loaded its new bytes silently. The refusal names the file and
    comes before the first row is copied."""
    import importlib

    load = importlib.import_module("shardwise.checkpoint.read.load")  # the module, not sw.load
    checkpoint = copy(small, tmp_path / "c")
    apply_states = load._apply_states

    def rewrite_then_apply(plan):
        data = bytearray((checkpoint / RANK_FILE).read_bytes())
        start = 8 + int.from_bytes(data[:8], "little") + header_of(checkpoint / RANK_FILE)["param/2.weight"][
            "data_offsets"][0]
        data[start] ^= 0xFF  # a parameter's first byte: same size, same header
        with open(checkpoint / RANK_FILE, "r+b") as f:
            f.write(data)
        apply_states(plan)

    monkeypatch.setattr(load, "_apply_states", rewrite_then_apply)
    parts = trained(seed=1)
    before = {key: value.clone() for key, value in parts[0].state_dict().items()}
    with pytest.raises(sw.ShardwiseError, match=f"{RANK_FILE} was written to .* changed after the load verified it"):
        load_small(checkpoint, parts)
    assert all(torch.equal(value, before[key]) for key, value in parts[0].state_dict().items())


@pytest.mark.parametrize("change, words", [
    (lambda i: i["optimizer"]["param_groups"][0]["options"].update(lr=math.nan), "not a finite number"),
    (lambda i: i["optimizer"]["param_groups"][0]["options"].update(lr=-1.0), "negative"),
    (lambda i: i["optimizer"]["param_groups"][0]["options"].update(foreach="yes please"), "not null, true/false"),
    (lambda i: i["optimizer"]["param_groups"][0]["options"].update(amsgrad=1), "not true or false"),
    (lambda i: i["scheduler"].update(step=0), "keys the scheduler's own state does not"),
    (lambda i: i["scheduler"].update(gamma=math.inf), "not a finite number"),
], ids=["lr-nan", "lr-negative", "foreach-string", "bool-as-int", "scheduler-step-key", "gamma-inf"])
def test_forged_settings_are_refused_before_anything_is_written(small, tmp_path, change, words):
    """Catches forged optimizer or scheduler settings loading as ok: JSON NaN as lr (the weights became
    NaN at the next step), `foreach: "yes please"`, a scheduler key `step` that replaced the method."""
    checkpoint = copy(small, tmp_path / "c")
    edit_index(checkpoint, change)
    parts = trained(seed=1)
    before = snapshot(parts)
    with pytest.raises(sw.ShardwiseError, match=words):
        load_small(checkpoint, parts)
    assert same(before, snapshot(parts))

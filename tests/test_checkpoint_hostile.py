"""Hostile and damaged checkpoints: nothing runs, every byte is checked, a refused load changes
nothing, and every refusal is a ShardwiseError naming the file and the field."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import pytest
import torch

import shardwise as sw
from helpers.damage import (
    RANK_FILE,
    copy,
    edit_header,
    edit_index,
    header_of,
    load_small,
    match_file_size,
    same,
    snapshot,
    trained,
)
from shardwise.checkpoint.interop import tools
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


# torch's weights-only reader notes the planted file's pickle protocol before refusing it: the refusal is the test
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
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


# ---- every byte covered; validate, then apply; malformed metadata --------------------------------


def _refused(path, match: str) -> str:
    """Load `path` into fresh parts: refused with `match`, and nothing the load writes changed."""
    parts = trained(seed=1)
    before = snapshot(parts)
    with pytest.raises(sw.ShardwiseError, match=match) as caught:
        load_small(path, parts)
    assert same(snapshot(parts), before), "a refused load changed the model, optimizer, scheduler or sampler"
    return str(caught.value)


def test_loads_whole_and_equal(small):
    """Catches the checks below refusing a good checkpoint, or a load that differs from the saved state."""
    assert same(snapshot(load_small(small)), snapshot(trained()))


@pytest.mark.parametrize("field,value", [("lr", 0.009), ("step", 7)])
def test_index_digest_refuses_an_edited_value(small, tmp_path, capsys, field, value):
    """Catches index.json without a digest: `lr` 0.001 -> 0.009 or `step` 2 -> 7 loaded silently and
    `ckpt inspect` called every file intact."""
    from shardwise.cli.main import main

    bad = copy(small, tmp_path / "bad")

    def change(index):
        if field == "lr":
            index["optimizer"]["param_groups"][0]["options"]["lr"] = value
        else:
            index["extra"]["step"] = value

    edit_index(bad, change, redigest=False)
    assert "does not match its own digest" in _refused(bad, "index.json")
    assert main(["ckpt", "inspect", str(bad)]) == 2
    assert "does not match its own digest" in capsys.readouterr().err


def test_rank_file_header_checked_against_the_index(small, tmp_path):
    """Catches a header byte F32 -> I32 loading the bytes as other values (the crcs cover data only),
    and an index dtype changed to F16 being ignored: the header must agree with the index."""
    bad = copy(small, tmp_path / "i32")
    edit_header(bad / RANK_FILE, lambda header: header.replace(b'"F32"', b'"I32"', 1))
    _refused(bad, "header says tensor 'param/0.weight' is I32 \\[8, 4\\], the index F32")
    other = copy(small, tmp_path / "metadata")  # any other header byte: the file's digest covers them all
    edit_header(other / RANK_FILE, lambda header: header.replace(b'"rank":"0"', b'"rank":"1"', 1))
    _refused(other, "header does not match the digest")
    forged = copy(small, tmp_path / "f16")
    edit_index(forged, lambda index: index["params"]["0.weight"].update(dtype="F16"))
    assert "header says tensor 'param/0.weight' is F32 [8, 4], the index F16" in _refused(forged, RANK_FILE)


def _flip(file, key: str) -> None:
    """Flip the last byte of tensor `key`'s data in safetensors `file`."""
    header = header_of(file)
    start = 8 + struct.unpack("<Q", file.read_bytes()[:8])[0]
    data = bytearray(file.read_bytes())
    data[start + header[key]["data_offsets"][1] - 1] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("key", ["rng/python", "optim/3.bias/exp_avg_sq", "buffer/3.running_var"])
def test_a_failed_load_leaves_model_and_optimizer_untouched(small, tmp_path, key):
    """Catches a load that fails late (a corrupt RNG tensor, the last optimizer row, the last
    buffer) after it has overwritten parameters and optimizer state: every byte is checked first."""
    bad = copy(small, tmp_path / "bad")
    _flip(bad / RANK_FILE, key)
    assert key in _refused(bad, "checksum mismatch")


def _first_slice(index):
    return index["params"]["0.weight"]["slices"][0]


def _rename_file(index, name):
    index["files"][name] = index["files"].pop(RANK_FILE)
    for kind in ("params", "buffers"):
        for entry in index[kind].values():
            for piece in entry["slices"]:
                piece["file"] = name


MALFORMED = {  # name: (change to a whole index (re-digested), what the error names)
    "params-a-list": (lambda i: i.update(params=list(i["params"].values())), "field params is a list"),
    "file-entry-a-list": (lambda i: i["files"].update({RANK_FILE: []}), r"safetensors'\] is \[\], not an object"),
    "shape-a-string": (lambda i: i["params"]["0.weight"]["shape"].__setitem__(0, "8"), r"shape\[0\] is '8'"),
    "negative-shape": (lambda i: i["params"]["0.weight"].update(shape=[-16, -8]), r"shape\[0\] is -16"),
    "chunk-zero": (lambda i: _first_slice(i).update(chunk=0), r"slices\[0\].chunk is 0"),
    "unknown-dtype": (lambda i: i["params"]["0.bias"].update(dtype="F33"), "dtype is 'F33'"),
    "unlisted-file": (lambda i: _first_slice(i).update(file="rank-00007-of-00009.safetensors"), "do not list"),
    "crcs-strings": (lambda i: _first_slice(i).update(crcs=["1"]), r"crcs\[0\] is '1'"),
    "saved_at-a-string": (lambda i: i.update(saved_at="yesterday"), "saved_at is 'yesterday'"),
    "saved_at-huge": (lambda i: i.update(saved_at=1e300), "saved_at is 1e"),
    "lr-a-string": (lambda i: i["optimizer"]["param_groups"][0]["options"].update(lr="0.001"), "'lr' is '0.001'"),
    "betas-short": (lambda i: i["optimizer"]["param_groups"][0]["options"].update(betas=[0.9]), "not a list of 2"),
    "group-params": (lambda i: i["optimizer"]["param_groups"][0]["options"].update(params=[]), "its parameters"),
    "step-a-string": (lambda i: next(iter(i["optimizer"]["state"].values()))["scalars"].update(step="x"), "'step'"),
    "scheduler-type": (lambda i: i["scheduler"].update(step_size="2"), "step_size"),
    "sampler-seed": (lambda i: i["objects"]["sampler"].update(seed=2**80), "ResumableSampler state is damaged"),
    "bad-base64": (lambda i: i["objects"]["sampler"].update(
        seed={"__tensor_bytes__": "no!base64", "shape": [1], "dtype": "uint8"}), "not base64"),
    "rng-pos": (lambda i: i["rng"][0]["numpy"].update(pos=2**80), "pos is"),
    "dot-dot": (lambda i: _rename_file(i, "../elsewhere/" + RANK_FILE), "not a plain file name"),
    "absolute": (lambda i: _rename_file(i, "/etc/passwd"), "not a plain file name"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_index_is_a_named_error(small, tmp_path, caplog, name):
    """Catches raw crashes (TypeError, KeyError, ZeroDivisionError, 'internal: ...'), values that fail
    later (lr as a string at opt.step(), a 2**80 seed while iterating), a file outside the checkpoint
    being read, and one bad sibling making sw.latest raise: each malformed field of a whole index is
    a ShardwiseError naming index.json and the field, in sw.load, sw.latest and every ckpt command."""
    from shardwise.cli.main import main

    change, match = MALFORMED[name]
    root = tmp_path / "run"
    good = copy(small, root / "good")
    bad = copy(small, root / "bad")
    edit_index(bad, change)
    message = _refused(bad, match)
    assert str(bad / "index.json") in message
    (bad / "index.json").touch()  # the newest by mtime too
    with caplog.at_level("WARNING", logger="shardwise.checkpoint"):
        assert sw.latest(root) in (good, bad)
    for command in (["inspect", str(bad)], ["export", str(bad), str(tmp_path / "out.safetensors")],
                    ["diff", str(bad), str(good)]):
        assert main(["ckpt", *command]) in (0, 1, 2), command  # a ShardwiseError is 2; no traceback


def test_latest_skips_a_damaged_sibling(small, tmp_path, caplog):
    """Catches a sibling's `saved_at` as a string making sw.latest raise TypeError for the whole directory."""
    good = copy(small, tmp_path / "good")
    bad = copy(small, tmp_path / "bad")
    edit_index(bad, lambda index: index.update(saved_at="yesterday"))
    with caplog.at_level("WARNING", logger="shardwise.checkpoint"):
        assert sw.latest(tmp_path) == good
    assert "skipping" in caplog.text and "bad" in caplog.text and "saved_at" in caplog.text


def test_deep_nesting_and_a_huge_index(small, tmp_path):
    """Catches 100k-deep JSON nesting (RecursionError) and a 512 MB sparse index.json read whole."""
    deep = copy(small, tmp_path / "deep")
    text = (deep / "index.json").read_text()
    nested = "[" * 100_000 + "]" * 100_000
    padding = '"pad":"' + "x" * 1_300_000 + '",'  # not dense in lists: the nesting check must refuse it
    (deep / "index.json").write_text(text.replace('"extra":{', '"extra":{' + padding + '"x":' + nested + ",", 1))
    _refused(deep, "nests")
    huge = copy(small, tmp_path / "huge")
    with open(huge / "index.json", "r+b") as f:
        f.truncate(512 * 2**20)
    _refused(huge, "more than any index")
    assert sw.latest(tmp_path) is None


def _nested(depth: int):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


def test_nesting_past_the_bound_python_parses(small, tmp_path):
    """Catches an index nested deeper than MAX_DEPTH (64) but not so deep that json.loads itself gives up:
    the bound is checked over the parsed values, a level at a time (issue 45), and a value at the bound loads."""
    deep = copy(small, tmp_path / "deep")
    edit_index(deep, lambda index: index["extra"].update(x=_nested(70)))  # the index, extra, then 70 lists
    assert "nests values 65 deep, more than the 64" in _refused(deep, "nests values")
    at_bound = copy(small, tmp_path / "at-bound")
    edit_index(at_bound, lambda index: index["extra"].update(x=_nested(62)))  # 64 levels in all
    model, optim, scheduler, sampler = trained(seed=1)
    assert sw.load(at_bound, model, optim, scheduler, sampler=sampler).extra["x"] == _nested(62)


def test_a_deeply_nested_rank_file_header(small, tmp_path, capsys):
    """Catches a rank file whose header is 100k-deep JSON nesting (its index re-made to match its size)
    escaping as a RecursionError from the checkpoint reader's own header parser, in sw.load and in
    `shardwise ckpt inspect`: one parser (wire/st_header.py) serves the reader and the host copy."""
    from shardwise.cli.main import main

    bad = copy(small, tmp_path / "deep")
    padding = b'"' + b"x" * 1_300_000 + b'",'  # not dense in lists: the nesting check must refuse it
    edit_header(bad / RANK_FILE, lambda header: b"[" + padding + b"[" * 100_000 + b"]" * 100_001)
    match_file_size(bad)
    assert RANK_FILE in _refused(bad, "nests too deeply")
    assert main(["ckpt", "inspect", str(bad)]) == 1  # the file is BAD, the command runs to its end
    assert "nests too deeply" in capsys.readouterr().out


def test_symlinks_are_refused(small, tmp_path):
    """Catches a symlinked rank file or index.json being followed out of the checkpoint directory."""
    elsewhere = copy(small, tmp_path / "elsewhere")
    linked = copy(small, tmp_path / "linked")
    (linked / RANK_FILE).unlink()
    (linked / RANK_FILE).symlink_to(elsewhere / RANK_FILE)
    _refused(linked, "symlink")
    index = copy(small, tmp_path / "index")
    (index / "index.json").unlink()
    (index / "index.json").symlink_to(elsewhere / "index.json")
    _refused(index, "symlink")


def _many_params_checkpoint(path: Path, count: int) -> list[str]:
    model = torch.nn.ModuleList(torch.nn.Linear(1, 1, bias=False) for _ in range(count))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    sw.save(path, model, optim)
    return [name for name, _ in model.named_parameters()]


def test_inspect_costs_one_pass_over_a_forged_owner_map(tmp_path, capsys):
    """Catches `ckpt inspect` counting each recorded owner once per rank of the shard group: a forged
    `shard_world` of 2^20 (the schema's cap) over 1000 parameters took 102 s and printed a 23 MB line.
    Only the ranks that own a parameter are listed (a bounded number of them), and a shard group larger
    than the world size that saved is refused."""
    from shardwise.cli.main import main

    names = _many_params_checkpoint(tmp_path / "ckpt", 400)

    def forge(world):
        def change(index):
            index["world_size"], index["rng"] = 2**20, []
            index["optimizer"]["owners"] = {"shard_world": world,
                                            "map": {name: (i * 2621) % world for i, name in enumerate(names)}}
        return change

    edit_index(tmp_path / "ckpt", forge(2**20))
    lines, _ = tools.inspect(tmp_path / "ckpt", verify=False)
    owners = next(line for line in lines if "whole-tensor owners" in line)
    assert len(owners) < 1000, len(owners)
    assert "shard group of 1048576" in owners and "rank 0 1 params" in owners and "more ranks" in owners
    edit_index(tmp_path / "ckpt", lambda index: index.update(world_size=8))
    assert main(["ckpt", "inspect", "--no-verify", str(tmp_path / "ckpt")]) == 2
    assert "more than the world size 8" in capsys.readouterr().err

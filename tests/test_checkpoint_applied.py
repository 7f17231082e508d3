"""Every byte a load leaves in the model passed its crc after it was read (issue 60, points 3 and 8; Note
[checked where applied] in checkpoint/read/mapped.py): a file changed between the load's check and its apply,
through a shared writable map whose dirty pages leave the file's times alone, or truncated, is an error
naming it, with no byte that failed its check in the model; never a silent load or SIGBUS."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.checkpoint.read import load as load_module
from shardwise.checkpoint.read.reader import FileReader

POISON = b"\x7f" * 4  # 3.39e38 as a float32


def _saved(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    sw.save(directory, model)
    return directory, {n: p.detach().clone() for n, p in model.named_parameters()}


def _only_checked_values(model: nn.Module, saved: dict, before: dict) -> bool:
    """Every element of every parameter is what the checkpoint holds, what the model held, or the zero a
    failed window is cleared to: never a byte that did not pass its crc."""
    return all(((p == saved[n]) | (p == before[n]) | (p == 0)).all() for n, p in model.named_parameters())


def test_a_rewrite_through_a_shared_map_between_check_and_apply_is_caught(tmp_path, monkeypatch):
    """Catches a load that applies bytes which never passed their crc: the pages of the file are dirtied
    through a shared writable map long before the load (so the file's times settle), and rewritten through
    the same map after the load checked them, which changes neither mtime nor ctime; the load returned
    normally with 3.4e38 in the model (its stamp "proved" the file unchanged), and a change it did detect
    was detected after the copy. Now: a ShardwiseError naming the file, and no poisoned value in the model."""
    path, saved = _saved(tmp_path / "c")
    file = next(path.glob("rank-*.safetensors"))
    with FileReader(file) as reader:
        entry = reader.entry("param/0.weight")
    fd = os.open(file, os.O_RDWR)
    shared = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        shared[entry.begin : entry.end] = shared[entry.begin : entry.end]  # dirty, the same bytes
        time.sleep(0.1)  # the file's times lie well behind the clock: a stamp settles on them
        checked = load_module.plan_load

        def check_then_rewrite(job):
            plan = checked(job)
            shared[entry.begin : entry.end] = POISON * ((entry.end - entry.begin) // 4)
            return plan

        monkeypatch.setattr(load_module, "plan_load", check_then_rewrite)
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(sw.ShardwiseError, match="checksum mismatch") as error:
            sw.load(path, model)
        assert file.name in str(error.value) and "changed after the load verified it" in str(error.value)
        assert _only_checked_values(model, saved, before), "bytes that failed their crc reached the model"
        assert not any((p.abs() > 1e38).any() for p in model.parameters())
    finally:
        shared.close()
        os.close(fd)


def _truncated_on_rank(directory: str, saved: dict) -> dict:
    """The first tensor copied, then rank 0 cuts every file off at the page where the next tensor in it
    begins (a map's read past the end of a file faults only on pages wholly beyond it)."""
    path = Path(directory)
    files = sorted(path.glob("rank-*.safetensors"))
    begins = []
    for file in files:
        with FileReader(file) as reader:
            begins.append({key: entry.begin for key, entry in reader.entries.items()})
    copy = load_module._read_into
    copied = []

    def copy_then_truncate(tensor, *args):
        copy(tensor, *args)
        copied.append(tensor.name)
        if len(copied) == 1:
            torch.distributed.barrier()
            if torch.distributed.get_rank() == 0:
                for file, where in zip(files, begins):
                    cut = min(b for key, b in where.items() if key != f"param/{tensor.name}")
                    os.truncate(file, cut - cut % mmap.PAGESIZE)  # the next copy's pages wholly past the end
            torch.distributed.barrier()

    load_module._read_into = copy_then_truncate
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        sw.load(path, model)
        message = None
    except sw.ShardwiseError as error:
        message = str(error)
    finally:
        load_module._read_into = copy
    return {"message": message, "checked": bool(_only_checked_values(model, saved, before))}


def test_a_file_truncated_while_the_load_copies_is_an_error_on_every_rank(ranks, tmp_path):
    """Catches a load that copies rows from its map of a file truncated after the check: the process died
    of SIGBUS (exit 135, no message, its peers waiting out the timeout). Now every rank raises a
    ShardwiseError naming the truncation, and holds no byte that did not pass its crc."""
    path, saved = _saved(tmp_path / "c")
    for rank, got in enumerate(ranks.run(_truncated_on_rank, 2, str(path), saved, timeout=60)):
        assert got["message"] is not None and "truncated" in got["message"], f"rank {rank}: {got['message']}"
        assert got["checked"], f"rank {rank}: unchecked bytes in the model"

"""Checkpoints at the disk's speed (issue 45): a load checks its rows over a map of each file, then reads
them once into the model and checks them again there (Note [checked where applied] in checkpoint/read/mapped.py);
a durable save starts the disk's writeback as it writes (Note [early writeback] in checkpoint/write/disk.py)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise as sw
from helpers.damage import load_small, same, snapshot, trained
from shardwise.checkpoint.format.files import TensorSpec, chunk_rows
from shardwise.checkpoint.read.reader import FileReader
from shardwise.checkpoint.write.disk import WRITEBACK_BYTES
from shardwise.checkpoint.write.writer import FileWriter


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {key: int(value) for key, value in (line.split(": ") for line in f if line.strip())}


def _evict(directory: Path) -> None:
    """Drop the files' clean pages from the page cache, so that the load's reads reach the disk."""
    for file in directory.iterdir():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io (Linux task I/O accounting)")
def test_a_load_reads_each_byte_once(tmp_path):
    """Catches the rows read twice (issue 35's re-read: every data byte went through `pread` twice, once to
    check it and once into the model): counted from /proc/self/io, a load from a cold page cache fetches at
    most 1.1x the checkpoint's bytes from the disk (read_bytes) and moves each byte through one read syscall
    (rchar: the apply's `pread` into the model; the checks read the map)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optim.step()
    sw.save(tmp_path / "c", model, optim)
    checkpoint_bytes = sum(f.stat().st_size for f in (tmp_path / "c").iterdir())
    data_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    fresh = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    fresh_optim = torch.optim.AdamW(fresh.parameters())
    _evict(tmp_path / "c")
    before = _io()
    sw.load(tmp_path / "c", fresh, fresh_optim)
    after = _io()
    read_bytes, rchar = after["read_bytes"] - before["read_bytes"], after["rchar"] - before["rchar"]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert read_bytes <= 1.1 * checkpoint_bytes, (read_bytes, checkpoint_bytes)
    assert data_bytes <= rchar <= 1.1 * checkpoint_bytes, f"{rchar} bytes through read syscalls, rows {data_bytes}"


def _two_tensor_file(path: Path):
    specs = [TensorSpec("a", torch.float32, (64, 8)), TensorSpec("b", torch.float32, (64, 8))]
    writer = FileWriter(path, specs, {})
    for number, spec in enumerate(specs):
        writer.write_next(torch.arange(512, dtype=torch.float32).reshape(64, 8) + 1000 * number)
    return writer.close(), chunk_rows((64, 8), torch.float32)


def test_rows_never_verified_are_checked_as_they_are_read(tmp_path):
    """Catches a read with crcs that skips the check of the bytes it read (rows the verify phase never
    checked): a corrupt tensor came back silently, its checksum unread."""
    written, chunk = _two_tensor_file(tmp_path / "f.safetensors")
    with open(tmp_path / "f.safetensors", "r+b") as f:  # corrupt b before the reader opens the file
        with FileReader(tmp_path / "f.safetensors") as reader:
            offset = reader.entry("b").begin
        f.seek(offset + 4)
        f.write(b"\xff")
    with FileReader(tmp_path / "f.safetensors") as reader:
        reader.verify_rows("a", 0, 64, crcs=written.crcs["a"], chunk=chunk)
        assert torch.equal(reader.read_rows("a", 0, 64, crcs=written.crcs["a"], chunk=chunk),
                           torch.arange(512, dtype=torch.float32).reshape(64, 8))
        with pytest.raises(sw.ShardwiseError, match="checksum mismatch"):
            reader.read_rows("b", 0, 64, crcs=written.crcs["b"], chunk=chunk)


def test_a_checked_load_equals_the_saved_values(small):
    """Catches a read at the wrong offset or of the wrong length: everything a load writes equals what was
    saved."""
    assert same(snapshot(trained(seed=0)), snapshot(load_small(small)))


@pytest.mark.parametrize("durable", [True, False])
def test_a_durable_save_starts_writeback_as_it_writes(tmp_path, monkeypatch, durable):
    """Catches a durable save leaving every byte to its final fsync (the disk idle while the save
    checksums: Note [early writeback]) or its tail (the disk idle while the ranks gather), a non-durable
    one asking for writeback at all, and phase times not recorded (Note [save phases])."""
    files = importlib.import_module("shardwise.checkpoint.write.writer")
    ranges = []
    monkeypatch.setattr(files, "start_writeback", lambda fd, offset, nbytes: ranges.append((offset, nbytes)))
    spec = TensorSpec("x", torch.float32, (80, 2**18))  # 80 MiB: two writeback ranges of 32 MiB
    writer = FileWriter(tmp_path / "f.safetensors", [spec], {}, durable=durable)
    writer.write_next(torch.zeros(80, 2**18))
    writer.close()
    if durable:  # two full ranges as it writes, then the tail once written: the whole file, in order
        assert len(ranges) == 3 and ranges[0][0] == 0, ranges
        assert all(offset == sum(before) for before, (offset, _) in zip(ranges, ranges[1:])), ranges
        assert all(nbytes >= WRITEBACK_BYTES for _, nbytes in ranges[:-1])
        assert sum(ranges[-1]) == (tmp_path / "f.safetensors").stat().st_size, ranges
    else:
        assert ranges == []
    phases = writer.phases
    assert phases.checksum > 0 and phases.write > 0 and (phases.fsync > 0) == durable, phases


def test_a_load_fills_the_optimizers_state_in_place(small):
    """Catches a load allocating a fresh tensor for every optimizer state it reads when the optimizer holds
    one of the same shape (each fresh buffer page-faults all its memory: the largest cost of a warm load
    before issue 45), and a state filled in place that ends up other than the checkpoint's."""
    parts = trained(seed=1)

    def pointers():
        return [v.data_ptr() for state in parts[1].state.values() for v in state.values()
                if torch.is_tensor(v) and v.dim()]

    before = pointers()
    load_small(small, parts)
    assert before and pointers() == before
    assert same(snapshot(trained(seed=0)), snapshot(parts))


def test_the_fast_crc32_is_zlibs_function():
    """Catches a crc32 other than zlib's (another polynomial, a running value that does not chain):
    checkpoints written with ISA-L's crc32 must read where only zlib is installed, and the other way
    round (Note [fast crc32]); and ISA-L installed but not used."""
    import zlib

    from shardwise.checkpoint.format import crc

    data = os.urandom(3 * 2**20 + 17)
    assert crc.crc32(data) == zlib.crc32(data)
    assert crc.crc32(data[1000:], crc.crc32(data[:1000])) == zlib.crc32(data)
    assert crc.crc32(b"") == 0 and crc.crc32(memoryview(data)[5:9], 7) == zlib.crc32(data[5:9], 7)
    try:
        from isal.isal_zlib import crc32 as isal_crc32
    except ImportError:
        pytest.skip("isal is not installed (pip install shardwise[fast])")
    assert crc.crc32 is isal_crc32

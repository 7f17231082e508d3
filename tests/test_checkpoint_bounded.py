"""Bounded work on hostile input and terminal-safe output (issue 35): size limits before parsing,
chunks of one huge row never held whole, bounded suggestions, streamed `ckpt diff --values`, FIFOs
refused, raw KeyError / UnicodeDecodeError turned into ShardwiseErrors, control characters escaped."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import tracemalloc

import pytest
import safetensors.torch
import torch
from torch import nn

import shardwise as sw
from helpers.damage import copy, edit_index, load_small
from shardwise.checkpoint.interop import tools
from shardwise.checkpoint.read.reader import file_digest
from shardwise.checkpoint.read.report import LoadReport, match
from shardwise.checkpoint.read.sources import Source, SourceTensor


def test_a_sibling_index_of_empty_objects_costs_latest_nothing(small, tmp_path, caplog):
    """Catches sw.latest parsing a 64 MiB `[{}, {}, ...]` index.json in a sibling directory: 21 million
    objects, +3.1 GiB RSS and 80 s per rank per call before the first check refused it."""
    copy(small, tmp_path / "good")
    (tmp_path / "bomb").mkdir()
    with open(tmp_path / "bomb" / "index.json", "wb") as f:
        f.write(b"[" + b"{}," * (20 * 2**20) + b"{}]")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="shardwise.checkpoint"):
        assert sw.latest(tmp_path) == tmp_path / "good"
    assert time.monotonic() - started < 5  # about 0.1 s; 80 s before
    assert "denser than any index" in caplog.text


def test_one_huge_row_is_checked_a_chunk_piece_at_a_time(tmp_path):
    """Catches `ckpt inspect` holding a whole checksum chunk in memory: a file declaring one row of N floats
    made it allocate N floats (a sparse file of 4 KiB declaring 1 TiB: a raw MemoryError)."""
    path = tmp_path / "row.safetensors"
    safetensors.torch.save_file({"x": torch.zeros(1, 16 * 2**20)}, path)  # one row of 64 MiB
    tracemalloc.start()
    try:
        file_digest(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak


def test_a_sparse_file_declaring_a_terabyte_is_checked_in_well_under_a_second(tmp_path):
    """Catches the checksum of a mostly-hole file read byte by byte (a 4 KiB file declaring 1 TiB: hours),
    and a hole-skipping crc that differs from zlib's over the same bytes."""
    import zlib

    from shardwise.checkpoint.format.sparse_crc import crc_of_range

    path = tmp_path / "holes.bin"
    with open(path, "wb") as f:
        for offset, data in ((0, b"abc" * 999), (5 * 2**20, b"xyz" * 5000), (7 * 2**20 + 99, b"q"), (30 * 2**20, b"e")):
            f.seek(offset)
            f.write(data)
        f.truncate(40 * 2**20)
    whole = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        def pread_into(view, offset):
            assert os.preadv(fd, [view], offset) == len(view)

        for start, size in ((0, len(whole)), (5 * 2**20 + 3, 2**20), (2**20, 3 * 2**20), (31 * 2**20, 9 * 2**20)):
            assert crc_of_range(fd, start, size, pread_into) == zlib.crc32(whole[start : start + size]), (start, size)
    finally:
        os.close(fd)
    huge = tmp_path / "huge.safetensors"
    header = b'{"x":{"dtype":"F32","shape":[1,274877906944],"data_offsets":[0,1099511627776]}}'
    header += b" " * (-len(header) % 8)
    with open(huge, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + 2**40)
    started = time.monotonic()
    file_digest(huge)
    assert time.monotonic() - started < 1


def test_suggestions_are_bounded(tmp_path):
    """Catches the difflib suggestions comparing every unmatched name with every other: 20k unmatched
    names against 20 parameters took 17 s (minutes at the size limit)."""
    source = Source()
    for i in range(20_000):  # each close enough to the model's names that difflib compares it in full
        name = f"encoder.blocks.{i}.attention.weights"
        source.tensors[name] = SourceTensor(name, (2,), torch.float32, (), lambda lo, hi, out: None)
    targets = {f"encoder.block.{i}.attention.weight": ((2,), [f"encoder.block.{i}.attention.weight"])
               for i in range(20)}
    report = LoadReport("x")
    started = time.monotonic()
    match(source, targets, report)
    assert time.monotonic() - started < 3  # machine loaded; about 0.3 s alone
    assert len(report.missing) == 20 and len(report.unexpected) == 20_000


def test_diff_values_streams_rows(tmp_path, monkeypatch):
    """Catches `ckpt diff --values` reading both tensors whole (and holding 12x the tensor in doubles)."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    safetensors.torch.save_file({"x": torch.zeros(4096, 4096)}, a)
    changed = torch.zeros(4096, 4096)
    changed[-1, -1] = 2.5
    safetensors.torch.save_file({"x": changed}, b)
    reads = []
    original = tools._largest_difference

    def watched(first, second, x, y):
        for side in (x, y):
            read = side.read
            side.read = lambda lo, hi, out, read=read: reads.append(hi - lo) or read(lo, hi, out)
        return original(first, second, x, y)

    monkeypatch.setattr(tools, "_largest_difference", watched)
    lines, same = tools.diff(a, b, values=True)
    assert not same and any("2.5" in line for line in lines), lines
    assert max(reads) * 4096 * 4 <= 16 * 2**20, max(reads)


class _Row(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.x = torch.nn.Parameter(value)


@pytest.mark.parametrize("kind", ["checkpoint", "safetensors", "torch"])
def test_diff_values_streams_one_huge_row_in_parts(tmp_path, monkeypatch, kind):
    """Catches `ckpt diff --values` reading a row larger than its block whole (a [1, N] tensor held N
    elements, twice, then 12x in doubles): every read is at most a block, the difference is still
    found, and a checkpoint's chunk crcs are still checked."""
    monkeypatch.setattr(tools, "_BLOCK_BYTES", 4096)  # a row of 16 KiB is then 4 blocks
    changed = torch.zeros(1, 4096)
    changed[0, -1] = 2.5
    paths = []
    for name, value in (("a", torch.zeros(1, 4096)), ("b", changed)):
        if kind == "checkpoint":
            paths.append(sw.save(tmp_path / name, _Row(value)))
        elif kind == "safetensors":
            safetensors.torch.save_file({"x": value}, tmp_path / f"{name}.safetensors")
            paths.append(tmp_path / f"{name}.safetensors")
        else:
            torch.save({"x": value}, tmp_path / f"{name}.pt")
            paths.append(tmp_path / f"{name}.pt")
    elements = []
    original = tools._largest_difference

    def watched(first, second, x, y):
        for side in (x, y):
            read, flat = side.read, side.read_flat
            side.read = lambda lo, hi, out, read=read: elements.append((hi - lo) * 4096) or read(lo, hi, out)
            side.read_flat = lambda start, stop, flat=flat: elements.append(stop - start) or flat(start, stop)
        return original(first, second, x, y)

    monkeypatch.setattr(tools, "_largest_difference", watched)
    lines, same = tools.diff(*paths, values=True)
    assert not same and any("2.5" in line for line in lines), lines
    assert elements and max(elements) * 4 <= 4096, elements
    if kind == "checkpoint":
        file = paths[1] / "rank-00000-of-00001.safetensors"
        data = bytearray(file.read_bytes())
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        end = next(8 + int.from_bytes(data[:8], "little") + entry["data_offsets"][1]
                   for entry in header.values() if isinstance(entry, dict) and entry.get("shape") == [1, 4096])
        data[end - 8] ^= 0xFF  # inside the row's last block
        file.write_bytes(bytes(data))
        with pytest.raises(sw.ShardwiseError, match="checksum mismatch"):
            tools.diff(*paths, values=True)


def test_a_fifo_is_refused_not_read(tmp_path):
    """Catches `sw.load("x.fifo", m)` and `ckpt diff ckpt x.fifo` blocking forever on a FIFO's open."""
    fifo = tmp_path / "x.fifo"
    os.mkfifo(fifo)
    outcome = []

    def attempt():
        try:
            sw.load(fifo, nn.Linear(2, 2))
        except sw.ShardwiseError as error:
            outcome.append(str(error))
        try:
            tools.diff(fifo, tmp_path)
        except sw.ShardwiseError as error:
            outcome.append(str(error))

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # unblock it: a writer end
        os.close(os.open(fifo, os.O_RDWR))
        pytest.fail("reading a FIFO blocked")
    assert len(outcome) == 2 and all("not a regular file" in message for message in outcome), outcome


def test_objects_by_rank_without_the_key_is_a_shardwise_error(small, tmp_path):
    """Catches `objects_by_rank=[{}]` (a forged index) raising a raw KeyError from sw.load."""
    checkpoint = copy(small, tmp_path / "c")
    edit_index(checkpoint, lambda index: index.update(objects_by_rank=[{}]))
    with pytest.raises(sw.ShardwiseError, match="objects_by_rank holds no state of sampler="):
        load_small(checkpoint)


def test_a_hello_that_is_not_text_does_not_kill_rank_0():
    """Catches a hello of bytes b"\\xff\\xfe" under the store's hello key killing rank 0 with a raw
    UnicodeDecodeError (any local process can write it)."""
    import torch.distributed as dist

    from shardwise.dist import _answer_hellos

    store = dist.HashStore()
    store.add("shardwise/hello/1/count", 1)
    store.set("shardwise/hello/1/1", b"\xff\xfe")
    assert _answer_hellos(store, 1, 0, "token", "run") == 1


def test_ckpt_commands_escape_control_characters(tmp_path, capsys):
    """Catches `shardwise ckpt inspect` printing raw control characters from names: an OSC 52 clipboard
    write, or cursor-up-and-erase that hides the lines saying CORRUPT."""
    from shardwise.cli.main import main

    model = nn.Module()
    hostile = "w\x1b]52;c;cm0gLXJmIH4=\x07\x1b[1A\x1b[2K"
    model.add_module(hostile, nn.Linear(2, 2))
    sw.save(tmp_path / "ckpt", model, note="\x1b[31mred\u202e")
    assert main(["ckpt", "inspect", str(tmp_path / "ckpt")]) == 0
    assert main(["ckpt", "diff", str(tmp_path / "ckpt"), str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "w\\x1b]52;c;" in out
    assert main(["ckpt", "inspect", str(tmp_path / "no\x1b[2Jpe")]) == 2
    assert "\x1b" not in capsys.readouterr().err

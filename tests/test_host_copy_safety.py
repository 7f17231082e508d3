"""The host copy against damaged and hostile input (Note [host copy file], Note [host copy], st_header.py).

A `source=` file whose header lies about its offsets, or that shrinks while mapped; the written
copy's permissions; and what is left in the directory when the writer or another rank dies
between writing the copy and removing it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch
import torch
from torch import nn

import shardwise as sw
from shardwise.engine.memory import host_copy


def _frozen_model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))
    model[0].requires_grad_(False)
    return model


def _rewrite_header(path, edit) -> None:
    """Apply `edit(header)` to the safetensors file at `path`, keeping its data bytes."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + length]), raw[8 + length:]
    data = edit(header, data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def _move_by_8(header, data):
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    header[name]["data_offsets"] = [x + 8 for x in header[name]["data_offsets"]]
    return data + bytes(8)  # the file is long enough for the moved entry: only the offsets check can tell


def _past_the_end(header, data):
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    begin, end = header[name]["data_offsets"]
    header[name]["shape"] = [(end - begin) // 4 + 1024]  # F32: a consistent entry, 4 KiB past the file's end
    header[name]["data_offsets"] = [begin, end + 4096]
    return data


def _wrong_dtype_size(header, data):
    name = next(k for k in header if k != "__metadata__" and len(header[k]["shape"]) == 2)
    header[name]["data_offsets"][1] -= 4
    return data


def _shard_from(path):
    model = _frozen_model()
    before = dict(model.named_parameters())
    try:
        sw.shard(model, strategy="ddp", frozen=sw.HostFrozen(source=path))
    except sw.ShardwiseError as error:
        return str(error), all(param is before[name] for name, param in model.named_parameters())
    return None, False


@pytest.mark.parametrize("edit, words", [(_move_by_8, "gap or overlap"), (_past_the_end, "truncated"),
                                         (_wrong_dtype_size, "for shape")])
def test_a_source_header_that_lies_about_its_offsets_is_refused(ranks, tmp_path, edit, words):
    """Catches `HostFrozen(source=...)` mapping a header's data_offsets unchecked: moved by 8 bytes, every
    weight of that tensor is read shifted by two floats; past the end, the first read is a SIGBUS."""
    path = tmp_path / "base.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in _frozen_model().state_dict().items()}, path)
    _rewrite_header(path, edit)
    [(message, untouched)] = ranks.run(_shard_from, 1, str(path))
    assert message is not None and words in message, message
    assert untouched  # nothing half-applied: the model keeps its own parameters


def _shrink_between_forwards(path):
    model = _frozen_model(64)  # 16 KiB of weights: pages past a 64-byte file are gone, not zero-filled
    sw.shard(model, strategy="ddp", frozen=sw.HostFrozen(source=path))
    model(torch.ones(2, 64))
    os.truncate(path, 64)  # someone rewrites the mapped file in place
    try:
        model(torch.ones(2, 64))
    except sw.ShardwiseError as error:
        return str(error)
    return None


def test_a_mapped_source_file_that_shrinks_is_an_error_not_sigbus(ranks, tmp_path):
    """Catches a truncated `source=` file killing the rank with SIGBUS at its next forward."""
    path = tmp_path / "base.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in _frozen_model(64).state_dict().items()}, path)
    [message] = ranks.run(_shrink_between_forwards, 1, str(path))
    assert message is not None and "shrank" in message, message


def _rewrite_in_place_between_forwards(path):
    model = _frozen_model(64)
    sw.shard(model, strategy="ddp", frozen=sw.HostFrozen(source=path))
    model(torch.ones(2, 64))
    raw = bytearray(open(path, "rb").read())
    raw[-4:] = struct.pack("<f", 123.0)
    with open(path, "r+b") as f:  # what `cp new old` does: the same inode, new bytes, same size
        f.write(raw)
    try:
        model(torch.ones(2, 64))
    except sw.ShardwiseError as error:
        return str(error)
    return None


def test_a_mapped_source_file_rewritten_in_place_is_an_error(ranks, tmp_path):
    """Catches a `source=` file rewritten in place (same size) changing the frozen weights under the model
    silently: only a shrink was detected."""
    path = tmp_path / "base.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in _frozen_model(64).state_dict().items()}, path)
    [message] = ranks.run(_rewrite_in_place_between_forwards, 1, str(path))
    assert message is not None and "written to while" in message, message


def _shard_from_own_file(directory):
    """Each rank maps its own `source=` file, as each host would map its own copy."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = _frozen_model()
    with torch.no_grad():
        model[0].weight.add_(rank)  # rank 1's host holds other frozen values
    path = os.path.join(directory, f"base-{rank}.safetensors")
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    try:
        sw.shard(_frozen_model(), strategy="ddp", frozen=sw.HostFrozen(source=path))
    except sw.ShardwiseError as error:
        return str(error)
    return None


def test_source_files_that_differ_between_hosts_are_refused(ranks, tmp_path):
    """Catches `source=` files that differ per host never being compared: rank 0 and rank 1 trained
    against different frozen values without an error."""
    messages = ranks.run(_shard_from_own_file, 2, str(tmp_path))
    for message in messages:
        assert message is not None and "different bytes on different hosts" in message, message


def _written_copy_modes(directory):
    seen = {}
    original = host_copy._map

    def recording_map(path, *args, **kwargs):  # between the write and the removal
        seen.update(file=stat.S_IMODE(os.stat(path).st_mode), directory=stat.S_IMODE(os.stat(path.parent).st_mode),
                    parent=str(path.parent.parent))
        return original(path, *args, **kwargs)

    host_copy._map = recording_map
    try:
        sw.shard(_frozen_model(), strategy="zero2", frozen=sw.HostFrozen(directory=directory))
    finally:
        host_copy._map = original
    import torch.distributed as dist

    dist.barrier()
    return seen, sorted(os.listdir(directory))


def test_the_written_copy_is_private_and_gone_once_mapped(ranks, tmp_path):
    """Catches a host copy readable by other local users (mode 0644, in a directory anyone can list),
    and a copy left in shared memory after every rank mapped it."""
    for seen, left in ranks.run(_written_copy_modes, 2, str(tmp_path)):
        assert seen == {"file": 0o600, "directory": 0o700, "parent": str(tmp_path)}, seen
        assert left == [], left


HOST_JOB = textwrap.dedent("""
    import os, signal, sys, torch
    from torch import nn
    import shardwise as sw
    from shardwise.engine.memory import host_copy

    directory, mode = sys.argv[1], sys.argv[2]
    sw.init(timeout=20)
    original = host_copy._map

    def dying_map(*args, **kwargs):  # after the writer wrote the copy, before its removal
        if mode == "kill-writer" and sw.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "peer-dies" and sw.get_rank() == 1:
            os._exit(3)
        return original(*args, **kwargs)

    host_copy._map = dying_map
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    model[0].requires_grad_(False)
    try:
        sw.shard(model, strategy="ddp", frozen=sw.HostFrozen(directory=directory))
    except sw.ShardwiseError as error:
        print("refused:", error, flush=True)
    print("left:", sorted(os.listdir(directory)), flush=True)
""")


def _hand_launch(tmp_path, world_size, directory, mode):
    script = tmp_path / "host_job.py"
    script.write_text(HOST_JOB)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                   RANK=str(rank), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(subprocess.Popen([sys.executable, str(script), str(directory), mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return [(p.communicate(timeout=120)[0], p.returncode) for p in procs]


def test_a_copy_left_by_a_killed_writer_is_swept_at_the_next_start(tmp_path):
    """Catches a SIGKILL between writing the host copy and removing it leaving the copy in shared memory for
    good: the next start on the host (another job) must remove it."""
    directory = tmp_path / "shm"
    directory.mkdir()
    [(out, code)] = _hand_launch(tmp_path, 1, directory, "kill-writer")
    assert code == -signal.SIGKILL, out
    assert [p.name for p in directory.iterdir() if p.name.startswith("shardwise-host")], "the kill left nothing"
    [(out, code)] = _hand_launch(tmp_path, 1, directory, "normal")
    assert code == 0 and "left: []" in out, out


def test_a_rank_dying_while_mapping_leaves_no_copy(tmp_path):
    """Catches the writer keeping the copy when another rank dies between the write and the mapping
    handshake (the handshake raises; the removal must run anyway)."""
    directory = tmp_path / "shm"
    directory.mkdir()
    (out0, _), (_, code1) = _hand_launch(tmp_path, 2, directory, "peer-dies")
    assert code1 == 3
    assert list(directory.iterdir()) == [], out0


def test_the_sweep_spares_a_copy_whose_writer_holds_its_lock(tmp_path):
    """Catches the sweep judging a writer dead by its pid: a same-user host copy of another container
    sharing /dev/shm (another pid namespace: no /proc entry here) was deleted under its live job."""
    import fcntl

    from shardwise.engine.memory import host_file

    live, dead = (tmp_path / f"{host_file.PREFIX}{2**22 + i}-1-abcdef" for i in range(2))
    live.mkdir()
    dead.mkdir()
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the other container's writer, alive
    try:
        assert host_file.sweep_stale(tmp_path) == [dead]
    finally:
        os.close(fd)
    assert live.is_dir() and not dead.exists()


def _shard_beside_a_twin(directory):
    """Rank 1 plants a twin of the leader's directory (same token, anyone can list /dev/shm) first."""
    import fcntl

    import torch.distributed as dist

    from shardwise.engine.memory import host_file

    host_copy.new_token = lambda: "feedfacefeedface"
    if dist.get_rank() == 1:  # named after a live process, and locked: no sweep removes it
        pid = os.getpid()
        twin = os.path.join(directory, f"{host_file.PREFIX}{pid}-{host_file._start_time(pid)}-feedfacefeedface")
        os.mkdir(twin)
        fcntl.flock(os.open(twin, os.O_RDONLY), fcntl.LOCK_EX)
    dist.barrier()
    model = _frozen_model()
    sw.shard(model, strategy="ddp", frozen=sw.HostFrozen(directory=directory))
    return float(model(torch.ones(1, 8)).sum())


def test_a_twin_directory_does_not_stop_the_ranks_mapping(ranks, tmp_path):
    """Catches the ranks finding the leader's copy by a search for its token: a twin directory with the
    same token (planted by anyone who lists /dev/shm) made every rank fail to map."""
    outputs = ranks.run(_shard_beside_a_twin, 2, str(tmp_path), timeout=120)
    assert outputs[0] == outputs[1]

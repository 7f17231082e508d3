"""Bad checkpoints and failed saves: each error names the problem, and the checkpoints that
were there before stay the latest and load."""

from __future__ import annotations

import json
import shutil

import pytest

import shardwise as sw
from helpers.ckpt_more_ranks import load_gpt_error, save_and_die, save_gpt, save_with_full_disk
from shardwise.checkpoint.format.schema import index_digest
from shardwise.models.zoo import build


@pytest.fixture(scope="module")
def good(ranks, tmp_path_factory):
    """A directory with one good checkpoint (gpt, zero2 on 2 ranks) and one of another model."""
    root = tmp_path_factory.mktemp("ckpts")
    ranks.run(save_gpt, 2, "zero2", str(root / "step-1"), timeout=120)
    other = tmp_path_factory.mktemp("other")
    model = build("odd_shapes")
    sw.save(other / "odd", model)
    return root, root / "step-1", other / "odd"


def _load_error(path) -> str:
    """Load `path` into an unwrapped GPT in this process (reads every rank's file)."""
    with pytest.raises(sw.ShardwiseError) as caught:
        sw.load(path, build("gpt", seed=3))
    return str(caught.value)


def _assert_still_loadable(root, checkpoint):
    assert sw.latest(root) == checkpoint
    report = sw.load(checkpoint, build("gpt", seed=4))
    assert report.ok, str(report)


def _corrupt_copy(good_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(good_dir, bad)
    return bad


def test_truncated_shard_file(good, tmp_path):
    """Catches a truncated file being read as if whole (zeros or garbage as weights)."""
    root, checkpoint, _ = good
    bad = _corrupt_copy(checkpoint, tmp_path)
    file = bad / "rank-00001-of-00002.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    message = _load_error(bad)
    assert "rank-00001-of-00002.safetensors" in message and "truncated" in message
    _assert_still_loadable(root, checkpoint)


def test_flipped_bytes_fail_every_rank(ranks, good, tmp_path):
    """Catches silent corruption: bytes flipped in one rank's file must fail the load with a
    checksum error on every rank, including the rank that never reads that file (a rank
    that raised alone would leave the others hanging in the next collective)."""
    root, checkpoint, _ = good
    bad = _corrupt_copy(checkpoint, tmp_path)
    file = bad / "rank-00000-of-00002.safetensors"
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    file.write_bytes(bytes(data))
    messages = ranks.run(load_gpt_error, 2, "zero2", str(bad), timeout=120)
    for rank, message in enumerate(messages):
        assert "checksum mismatch" in message and "rank-00000-of-00002.safetensors" in message, (rank, message)
    assert "rank 0 could not load" in messages[1]
    _assert_still_loadable(root, checkpoint)


def test_missing_shard_file(good, tmp_path):
    """Catches a partial copy of a checkpoint loading with some rows never set."""
    root, checkpoint, _ = good
    bad = _corrupt_copy(checkpoint, tmp_path)
    (bad / "rank-00001-of-00002.safetensors").unlink()
    message = _load_error(bad)
    assert "rank-00001-of-00002.safetensors" in message and "missing" in message
    _assert_still_loadable(root, checkpoint)


def test_index_from_another_checkpoint(good, tmp_path):
    """Catches an index.json copied over from another checkpoint being trusted: it must not
    read another model's byte ranges as this one's."""
    root, checkpoint, other = good
    bad = _corrupt_copy(checkpoint, tmp_path)
    shutil.copy(other / "index.json", bad / "index.json")
    (bad / "rank-00000-of-00001.safetensors").write_bytes(b"")  # the name the other index lists
    message = _load_error(bad)
    assert "rank-00000-of-00001.safetensors" in message and "another checkpoint" in message
    # Same file names and sizes, different checkpoint: caught by the id in every file's header.
    twin = tmp_path / "twin"
    shutil.copytree(checkpoint, twin)
    index = json.loads((twin / "index.json").read_text())
    index["id"] = "0" * 32
    index["digest"] = index_digest(index)  # a whole index of another checkpoint, not a damaged one
    (twin / "index.json").write_text(json.dumps(index))
    assert "copied from another checkpoint" in _load_error(twin)
    _assert_still_loadable(root, checkpoint)


def test_directory_that_is_not_a_checkpoint(good, tmp_path):
    """Catches a confusing error (or a silent empty load) for the wrong directory, and
    points at the checkpoints inside a run directory."""
    root, checkpoint, _ = good
    (tmp_path / "empty").mkdir()
    assert "not a shardwise checkpoint" in _load_error(tmp_path / "empty")
    message = _load_error(root)
    assert "not a shardwise checkpoint" in message and "step-1" in message and "sw.latest" in message
    assert "does not exist" in _load_error(tmp_path / "nowhere")
    _assert_still_loadable(root, checkpoint)


def test_disk_full_during_save(ranks, good):
    """Catches a failed write leaving a checkpoint that looks whole, a rank hanging because
    another failed, or an error that does not say which rank and why."""
    root, checkpoint, _ = good
    messages = ranks.run(save_with_full_disk, 2, "zero2", str(root / "step-2"), 1, timeout=120)
    for message in messages:
        assert "rank 1" in message and "No space left on device" in message, message
    assert not (root / "step-2").exists() and not (root / ".step-2.partial").exists()
    _assert_still_loadable(root, checkpoint)


def test_rank_killed_mid_save(ranks, good):
    """Catches a crash mid-save leaving a directory that sw.latest or sw.load takes for a
    checkpoint; a later save to the same name must clean the leftover up and succeed."""
    from helpers.harness import RankFailed

    root, checkpoint, _ = good
    # The harness reports the death, or rank 0's collective breaking on it (gloo's wording
    # varies: reset, closed, broken pipe), whichever comes first.
    with pytest.raises(RankFailed) as caught:
        ranks.run(save_and_die, 2, "zero2", str(root / "step-3"), 1, timeout=60)
    assert "rank 1 process died" in str(caught.value) or "in save_and_die" in str(caught.value), caught.value
    assert not (root / "step-3").exists() and (root / ".step-3.partial").exists()
    _assert_still_loadable(root, checkpoint)
    ranks.run(save_gpt, 2, "zero2", str(root / "step-3"), timeout=120)
    assert sw.latest(root) == root / "step-3" and not (root / ".step-3.partial").exists()
    assert sw.load(root / "step-3", build("gpt", seed=4)).ok
    shutil.rmtree(root / "step-3")  # leave the module's directory as the other tests expect it


def test_no_pickle_anywhere(good, monkeypatch):
    """Catches any unpickling on load: a checkpoint from an untrusted source must run no code."""
    import pickle

    _, checkpoint, _ = good
    assert sorted(p.suffix for p in checkpoint.iterdir()) == [".json", ".safetensors", ".safetensors"]

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used while loading a checkpoint")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    assert sw.load(checkpoint, build("gpt", seed=3)).ok


def test_save_refuses_to_overwrite_what_is_not_a_checkpoint(tmp_path):
    """Catches sw.save deleting a user's directory that happens to have the target's name."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("mine")
    with pytest.raises(sw.ShardwiseError, match="not a shardwise checkpoint; refusing to overwrite"):
        sw.save(tmp_path / "data", build("gpt"))
    assert (tmp_path / "data" / "keep.txt").read_text() == "mine"


def test_keep_last_and_latest(tmp_path):
    """Catches keep_last deleting the newest checkpoints, the one just saved or other files, and
    sw.latest picking a partial save or going by name instead of the saver's order (step, then save
    counter: Note [newest])."""
    model = build("gpt")
    (tmp_path / "notes").mkdir()
    for step in (30, 100, 20):  # names that sort differently from save order
        sw.save(tmp_path / f"step-{step}", model, keep_last=2, step=step)
    (tmp_path / ".step-40.partial").mkdir()
    sw.save(tmp_path / "step-5", model, keep_last=2, step=5)  # an earlier step, saved last: kept, not newest
    # the empty .step-40.partial (a save killed between its mkdir and its mark) went with the sweep
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step-100", "step-30", "step-5"]
    assert sw.latest(tmp_path) == tmp_path / "step-100"
    sw.save(tmp_path / "step-7", model, keep_last=2)  # no step: after every checkpoint beside it
    assert sw.latest(tmp_path) == tmp_path / "step-7"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step-100", "step-7"]
    sw.save(tmp_path / "step-100", model, step=101)  # overwriting makes it the newest
    assert sw.latest(tmp_path) == tmp_path / "step-100"
    assert sw.load(tmp_path / "step-100", build("gpt", seed=2)).extra == {"step": 101}
    assert sw.latest(tmp_path / "nowhere") is None

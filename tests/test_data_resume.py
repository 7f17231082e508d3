"""torchdata's StatefulDataLoader (two workers per rank) saved and restored by sw.save / sw.load
(Note [object states] in checkpoint/write/save.py): it resumes exactly where it stopped. Run under
torchrun: a data loader's workers cannot start inside the test pool's daemon processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchdata")

SCRIPT = Path(__file__).parent / "scripts" / "data_resume.py"


def _launch(world_size: int, out: Path, *args: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={world_size}", str(SCRIPT), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world_size)]


@pytest.fixture(scope="module")
def stopped_at_3(tmp_path_factory):
    """Two ranks save their loaders after step 3 and go on to step 7, the run a resume must continue: (the
    checkpoint, what each rank saw in all). Both tests below start from it, each from a copy; the one launch is
    both the run that saved and the uninterrupted run (a launch of torchrun is seconds of CPU)."""
    folder = tmp_path_factory.mktemp("stopped")
    whole = _launch(2, folder / "first", "--path", str(folder / "ckpt"), "--save-at", "3")
    return folder / "ckpt", whole


def test_stateful_dataloader_resumes_exactly(tmp_path, stopped_at_3):
    """Catches a loader restarted from its epoch's beginning (the batches after resume repeat the
    first ones), one rank's position handed to another, and a generator state refused by sw.save."""
    saved, whole = stopped_at_3
    path = shutil.copytree(saved, tmp_path / "ckpt")
    rest = _launch(2, tmp_path / "rest", "--path", str(path), "--resume", "--total", "4")
    for rank in range(2):
        assert whole[rank]["error"] is None and rest[rank]["error"] is None, (whole, rest)
        assert whole[rank]["seen"][:3] + rest[rank]["seen"] == whole[rank]["seen"], (rank, rest, whole)
        # An epoch never repeats a sample: the run went on after its save, so a save that restarted the live
        # loader would show here (it would also restart in the resumed run and match it there).
        samples = [x for batch in whole[rank]["seen"] for x in batch]
        assert len(samples) == 21 and len(set(samples)) == 21, whole[rank]["seen"]
    assert whole[0]["seen"] != whole[1]["seen"]  # each rank its own samples


def test_per_rank_loader_states_refuse_another_world_size(tmp_path, stopped_at_3):
    """Catches rank 0's loader position silently given to every rank of a different world size."""
    path = shutil.copytree(stopped_at_3[0], tmp_path / "ckpt")
    (resumed,) = _launch(1, tmp_path / "rest", "--path", str(path), "--resume")
    assert resumed["error"] is not None and "saved at world size 2 and is loaded at 1" in resumed["error"], resumed


class Position:
    """A stateful object whose state differs per rank (an iterable dataset's shard position)."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value, "generator": torch.Generator().manual_seed(self.value).get_state()}

    def load_state_dict(self, state):
        self.value = state["value"]
        assert torch.equal(state["generator"], torch.Generator().manual_seed(self.value).get_state())


def _save_positions(path):
    import shardwise as sw
    model = torch.nn.Linear(2, 2)
    sw.shard(model, strategy="zero3")
    sw.save(path, model, position=Position(10 + dist.get_rank()))


def _load_positions(path):
    import shardwise as sw
    model = torch.nn.Linear(2, 2)
    sw.shard(model, strategy="zero3")
    position = Position(-1)
    try:
        sw.load(path, model, position=position)
    except sw.ShardwiseError as error:
        return str(error)
    return position.value


def test_each_rank_gets_its_own_object_state_back(ranks, tmp_path):
    """Catches rank 0's state handed to every rank (the index stored one state for all) and a
    generator state tensor that did not round-trip."""
    path = str(tmp_path / "ckpt")
    ranks.run(_save_positions, 2, path)
    assert ranks.run(_load_positions, 2, path) == [10, 11]
    (message,) = ranks.run(_load_positions, 1, path)
    assert "saved at world size 2 and is loaded at 1" in message, message

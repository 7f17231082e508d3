"""The Trainer's `checkpoint-N/` directories under ShardwiseTrainer: whole or absent, and resumed only when whole.

Note [whole trainer checkpoints]: the plain Trainer writes `checkpoint-N/` piece by piece (the
model, then the optimizer, the RNG states, trainer_state.json); a save that raises half-way (an
optimizer whose state cannot be saved, a full disk) leaves a `checkpoint-N/` that
`resume_from_checkpoint=True` then picks and fails on. ShardwiseTrainer writes every piece into
`.partial-checkpoint-N/checkpoint-N/` beside it (the Trainer's own `_save_checkpoint`, pointed
there), and once every rank has finished, rank 0 renames it to `checkpoint-N` and removes the
hidden directory: the Trainer's resume (`get_last_checkpoint`) and `save_total_limit` only ever
see whole checkpoints. A save that fails removes what it wrote. Resuming with
`resume_from_checkpoint=True` takes the newest `checkpoint-N` that is whole (trainer_state.json
and a readable `shardwise/` checkpoint), and says in one log line per checkpoint it skips why
(one written before this rule, or by the plain Trainer).

Note [weights-only checkpoints]: with `save_only_model=True` the Trainer writes the model alone
(`model.safetensors`, whole: ShardwiseTrainer.save_model gathers it) and no `shardwise/` part. The
plain Trainer resumes from such a checkpoint with the weights loaded and the optimizer and scheduler
started afresh; ShardwiseTrainer does the same, and says so in one log line. Under
`resume_from_checkpoint=True` such a checkpoint counts as whole only when the run saves that way too
(`save_only_model=True`): otherwise a missing `shardwise/` part means a save that failed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from shardwise.checkpoint.format.schema import read_index
from shardwise.errors import ShardwiseError

log = logging.getLogger("shardwise.integrations")
PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
SHARDWISE = "shardwise"  # the optimizer, scheduler and model rows, written by sw.save
MODEL = "model.safetensors"  # transformers' SAFE_WEIGHTS_NAME: the whole model, save_only_model=True's only part
OPTIMIZER = "optimizer.pt"  # transformers' OPTIMIZER_NAME: the plain Trainer's (pickled) optimizer state
_NAME = re.compile(rf"{PREFIX}-(\d+)")


def staging_dir(run_dir: str, step: int) -> str:
    """Where the save of `checkpoint-{step}` writes until it is whole (Note [whole trainer checkpoints])."""
    return os.path.join(run_dir, f".partial-{PREFIX}-{step}")


def start(staging: str, group) -> None:
    """Rank 0 removes what an interrupted save of the same step left; every rank then waits."""
    if _rank(group) == 0 and os.path.lexists(staging):
        shutil.rmtree(staging, ignore_errors=True)
    _barrier(group)


def publish(staging: str, run_dir: str, step: int, group) -> str:
    """Make the finished `staging/checkpoint-{step}` the checkpoint `run_dir/checkpoint-{step}`; its path."""
    name = f"{PREFIX}-{step}"
    final = os.path.join(run_dir, name)
    _barrier(group)  # every rank has written its part (trainer_state.json is rank 0's own, last)
    if _rank(group) == 0:
        if os.path.lexists(final):
            shutil.rmtree(final)  # a checkpoint of the same step from an earlier run: replaced whole
        os.rename(os.path.join(staging, name), final)
        shutil.rmtree(staging, ignore_errors=True)
    _barrier(group)
    return final


def abandon(staging: str, group) -> None:
    """After a failed save (raised on every rank): rank 0 removes what it wrote."""
    if _rank(group) == 0:
        shutil.rmtree(staging, ignore_errors=True)


def weights_only(path: Path) -> bool:
    """Whether Trainer checkpoint `path` holds the model alone (Note [weights-only checkpoints])."""
    return ((path / STATE).is_file() and (path / MODEL).is_file() and not os.path.lexists(path / SHARDWISE)
            and not os.path.lexists(path / OPTIMIZER))  # the plain Trainer's, with an optimizer.pt: not this kind


def why_not_whole(path: Path, weights_only_ok: bool = False) -> str | None:
    """Why Trainer checkpoint `path` cannot be resumed from; None when it is whole (a weights-only one
    when `weights_only_ok`: Note [weights-only checkpoints])."""
    if not (path / STATE).is_file():
        return f"it has no {STATE}"
    if weights_only_ok and weights_only(path):
        return None
    if not (path / SHARDWISE).is_dir():
        return (f"it has no {SHARDWISE}/ part (a save that failed before this version, one saved with "
                "save_only_model=True, or one the plain Trainer wrote)")
    try:
        read_index(path / SHARDWISE)
    except ShardwiseError as error:
        return f"its {SHARDWISE}/ part is not a whole checkpoint ({error})"
    return None


def last_whole(output_dir: str, report: bool = True, weights_only_ok: bool = False) -> str | None:
    """The newest whole `checkpoint-N` in `output_dir` (`weights_only_ok`: Note [weights-only checkpoints]);
    one log line for each newer one skipped (when `report`: rank 0 reports, the others look quietly)."""
    directory = Path(output_dir)
    found = sorted(((int(m.group(1)), child) for child in directory.iterdir() if child.is_dir()
                    and (m := _NAME.fullmatch(child.name))), reverse=True) if directory.is_dir() else []
    for _, path in found:
        reason = why_not_whole(path, weights_only_ok)
        if reason is None:
            return str(path)
        if report:
            log.warning("ShardwiseTrainer: not resuming from %s: %s", path, reason)
    return None


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def _barrier(group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.barrier(group=group)

"""ShardwiseTrainer's checkpoints appear whole or not at all, and a resume skips one that is not whole
(Note [whole trainer checkpoints] in integrations/trainer_checkpoints.py)."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

import shardwise as sw
from helpers.tiny import PerParameter, tiny_gpt2, tiny_lm_data


class OddState(PerParameter):
    """Plain SGD that keeps a Python set in its state: a value no checkpoint can hold without pickle."""

    def update(self, p, state, lr) -> None:
        state.setdefault("tags", {"a", "b"})
        p.add_(p.grad, alpha=-lr)


def _train(tmp, steps, save_steps, resume=None, odd=False, only_model=False):
    """A zero3 tiny GPT-2 under ShardwiseTrainer (`only_model`: save_only_model=True): (the ShardwiseError it
    raised or None, the final parameters, the integration's log lines, the losses logged by step: a resumed
    run's history holds the checkpoint's steps and its own after them)."""
    import transformers
    from accelerate.state import AcceleratorState

    from shardwise.integrations.transformers import ShardwiseTrainer

    AcceleratorState._reset_state(reset_partial_state=True)
    model, data = tiny_gpt2(), tiny_lm_data()
    args = transformers.TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-2, logging_steps=1,
        report_to=[], seed=0, save_strategy="steps", save_steps=save_steps, use_cpu=True,
        lr_scheduler_type="constant", disable_tqdm=True, save_only_model=only_model)
    sw.shard(model, strategy="zero3")
    optimizers = (OddState(model.parameters(), lr=0.1), None) if odd else (None, None)
    trainer = ShardwiseTrainer(model=model, args=args, train_dataset=data, optimizers=optimizers)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("shardwise.integrations").addHandler(handler)
    try:
        trainer.train(resume_from_checkpoint=resume)
    except sw.ShardwiseError as error:
        return str(error), None, [], {}
    finally:
        logging.getLogger("shardwise.integrations").removeHandler(handler)
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    return None, sw.full_parameters(model), [r.getMessage() for r in records], losses


def test_a_failed_save_leaves_no_checkpoint_and_names_the_users_optimizer(ranks, tmp_path):
    """Catches a failed first save leaving checkpoint-2/ without its shardwise/ part (which a resume
    then picked), an error naming Accelerate's AcceleratedOptimizer, and a fix that cannot be
    applied inside a Trainer (sw.save(path, model))."""
    out = str(tmp_path / "run")
    for error, _, _, _ in ranks.run(_train, 2, out, 2, 2, None, True, timeout=180):
        assert error is not None and "OddState" in error and "AcceleratedOptimizer" not in error, error
        assert "save_only_model=True" in error, error
    assert not [name for name in os.listdir(out) if "checkpoint" in name], os.listdir(out)


def test_resume_skips_a_checkpoint_that_is_not_whole(ranks, tmp_path):
    """Catches resume_from_checkpoint=True picking the newest checkpoint-N although its shardwise/ part
    is missing ("checkpoint-3/shardwise does not exist"): it resumes from checkpoint-2, says why in
    one log line, and ends where the uninterrupted run ended."""
    out = str(tmp_path / "run")
    (_, whole, _, _), _ = ranks.run(_train, 2, out, 3, 1, timeout=180)
    assert sorted(n for n in os.listdir(out) if "checkpoint" in n) == ["checkpoint-1", "checkpoint-2",
                                                                      "checkpoint-3"]
    shutil.rmtree(os.path.join(out, "checkpoint-3", "shardwise"))  # as a save that failed before this fix left it
    (error, resumed, logs, _), (_, _, quiet, _) = ranks.run(_train, 2, out, 3, 1, True, timeout=180)
    assert error is None, error
    assert len(logs) == 1 and "checkpoint-3" in logs[0] and "shardwise/" in logs[0], logs
    assert quiet == []  # rank 0 reports it, once
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-6, atol=1e-6)


def test_a_weights_only_checkpoint_resumes_as_the_trainer_does(ranks, tmp_path):
    """Catches save_only_model=True checkpoints (what shardwise's own error recommends) that could not be
    resumed: `resume_from_checkpoint=True` said "no whole checkpoint-N", an explicit path said
    ".../shardwise does not exist". As the plain Trainer: the weights are loaded (the resumed run's first
    loss, computed before any step, is the uninterrupted run's at that step), the optimizer and scheduler
    start afresh, and one log line says so (Note [weights-only checkpoints])."""
    out = str(tmp_path / "run")
    (_, _, _, whole), _ = ranks.run(_train, 2, out, 3, 1, None, False, True, timeout=180)
    assert "shardwise" not in os.listdir(os.path.join(out, "checkpoint-2"))
    shutil.rmtree(os.path.join(out, "checkpoint-3"))
    (error, _, logs, resumed), (_, _, quiet, _) = ranks.run(_train, 2, out, 3, 1, True, False, True, timeout=180)
    assert error is None and len(logs) == 1 and "checkpoint-2" in logs[0], (error, logs)
    assert "optimizer and scheduler start afresh" in logs[0] and quiet == [], logs
    assert sorted(resumed) == [1, 2, 3] and resumed[3] == pytest.approx(whole[3], abs=1e-6), (resumed, whole)
    checkpoint = os.path.join(out, "checkpoint-1")
    (error, _, logs, resumed), _ = ranks.run(_train, 2, out, 3, 1, checkpoint, False, True, timeout=180)
    assert error is None and "checkpoint-1" in logs[0] and resumed[2] == pytest.approx(whole[2], abs=1e-6)

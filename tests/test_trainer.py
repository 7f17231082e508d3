"""transformers' Trainer on a sharded model through ShardwiseTrainer (Note [trainer
integration]): losses, grad norms and parameters equal plain single-process training."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from helpers.parity import assert_trainer_run_matches
from helpers.tiny import tiny_gpt2, tiny_lm_data

STEPS = 3


def _train(tmp, strategy, world_size, accumulate, steps=STEPS, save_steps=None, resume=None, optim="adamw_torch"):
    import transformers
    from accelerate.state import AcceleratorState

    from shardwise.integrations.transformers import ShardwiseTrainer

    AcceleratorState._reset_state(reset_partial_state=True)  # the pool's processes run many tests
    model, data = tiny_gpt2(), tiny_lm_data()
    per_device = 8 // world_size // accumulate
    args = transformers.TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulate,
        max_steps=steps, learning_rate=1e-2, adam_epsilon=1e-3, max_grad_norm=0.5, logging_steps=1,
        report_to=[], seed=0, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        use_cpu=True, dataloader_drop_last=True, optim=optim,
        lr_scheduler_type="constant", disable_tqdm=True)
    if strategy == "none":
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    else:
        sw.shard(model, strategy=strategy)
        trainer = ShardwiseTrainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume)
    logs = [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]
    params = sw.full_parameters(model) if strategy != "none" else \
        {n: p.detach().clone() for n, p in model.named_parameters()}
    return logs, params


@pytest.mark.parametrize("strategy, accumulate", [("zero2", 1), ("zero3", 1), ("zero3", 2)])
def test_trainer_matches_single_process_training(ranks, tmp_path, strategy, accumulate):
    """Catches the Trainer's DDP wrap, its rank-local clipping (it logged one rank's norm: 1.227 for a
    true 1.695) or its accumulation reducing wrongly: 3 clipped AdamW steps at world size 2 must
    log the losses and grad norms of one process on the same global batches, and end equal."""
    (reference_logs, reference_params), = ranks.run(_train, 1, str(tmp_path / "one"), "none", 1, accumulate,
                                                    timeout=180)
    for logs, params in ranks.run(_train, 2, str(tmp_path / "two"), strategy, 2, accumulate, timeout=180):
        assert_trainer_run_matches(logs, params, reference_logs, reference_params, STEPS)


def test_trainer_checkpoints_resume_exactly(ranks, tmp_path):
    """Catches the Trainer's own checkpointing of a sharded model: its save gathered on rank 0 alone
    (the ranks' collectives mismatched and gloo aborted), and optimizer.pt holding rank 0's rows.
    zero3 at world size 2: 4 steps saving every 2, then a resume from checkpoint-2 ends equal."""
    out = str(tmp_path / "run")
    (_, whole), _ = ranks.run(_train, 2, out, "zero3", 2, 1, 4, 2, timeout=180)
    (_, resumed), _ = ranks.run(_train, 2, out, "zero3", 2, 1, 4, 2, f"{out}/checkpoint-2", timeout=180)
    from safetensors.torch import load_file
    exported = load_file(f"{out}/checkpoint-4/model.safetensors")
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-6, atol=1e-6)
        if name in exported:
            assert torch.equal(exported[name], value), name


def test_trainer_adafactor_resumes_bitwise(ranks, tmp_path):
    """Catches `Trainer(optim="adafactor")` checkpoints of a sharded model refused (Adafactor's row and
    column factors are not row-shaped, each lives whole on one owner rank) or resumed with the factors
    rebuilt from zero: zero2 at world size 2, 4 steps saving every 2; a run given checkpoint-2 and
    `resume_from_checkpoint=True` ends bitwise equal to the uninterrupted one."""
    import shutil

    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    (_, expected), _ = ranks.run(_train, 2, whole, "zero2", 2, 1, 4, 2, None, "adafactor", timeout=180)
    shutil.copytree(f"{whole}/checkpoint-2", f"{resumed}/checkpoint-2")
    (_, got), _ = ranks.run(_train, 2, resumed, "zero2", 2, 1, 4, 2, True, "adafactor", timeout=180)
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{name} differs after the resume"

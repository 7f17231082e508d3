"""ShardwiseTrainer and TrainingArguments (Note [trainer arguments] in integrations/trainer_args.py):
every field that changes the arithmetic or the data does what the plain Trainer does under torch
DDP on the same 2 ranks, or is refused when the trainer is built."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import shardwise as sw
from helpers.parity import log_distance
from shardwise.integrations.trainer_args import HONOURED, REFUSALS

STEPS = 3
# Each row: TrainingArguments overrides, and the fields of HONOURED it exercises beyond the base run's.
ROWS = {
    "base": ({}, ("max_grad_norm", "optim", "learning_rate", "adam_epsilon", "seed", "per_device_train_batch_size",
                  "dataloader_drop_last", "average_tokens_across_devices", "remove_unused_columns",
                  "label_names")),
    "bf16": ({"bf16": True}, ("bf16",)),
    "checkpointing": ({"activation_checkpointing": True,
                       "activation_checkpointing_kwargs": {"use_reentrant": False}},
                      ("activation_checkpointing", "gradient_checkpointing", "activation_checkpointing_kwargs",
                       "gradient_checkpointing_kwargs")),
    "accumulation": ({"gradient_accumulation_steps": 2, "per_device_train_batch_size": 1},  # 2 ranks only
                     ("gradient_accumulation_steps",)),
    "adafactor": ({"optim": "adafactor", "learning_rate": 1e-2}, ("optim", "optim_args")),
    "sgd": ({"optim": "sgd", "optim_args": "momentum=0.9", "weight_decay": 0.1, "learning_rate": 0.1},
            ("optim_args", "weight_decay")),
    "schedule": ({"lr_scheduler_type": "cosine", "warmup_steps": 1, "adam_beta1": 0.8, "adam_beta2": 0.9},
                 ("lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "adam_beta1", "adam_beta2")),
    "data": ({"data_seed": 7, "train_sampling_strategy": "group_by_length", "dataloader_drop_last": False,
              "average_tokens_across_devices": False, "full_determinism": True},
             ("data_seed", "train_sampling_strategy", "length_column_name", "dataloader_drop_last",
              "average_tokens_across_devices", "full_determinism", "accelerator_config", "dataloader_in_order")),
    "label_smoothing": ({"label_smoothing_factor": 0.1}, ("label_smoothing_factor",)),
    "neftune": ({"neftune_noise_alpha": 5.0}, ("neftune_noise_alpha",)),
    "flags": ({"tf32": False, "use_cache": False}, ("tf32", "use_cache")),
}


def _collate(samples):
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = sample["input_ids"], sample["input_ids"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _train(tmp, kind: str, overrides: dict):
    """One Trainer run on this rank: `kind` "plain" (transformers.Trainer: DDP on 2 ranks) or a zero
    strategy (ShardwiseTrainer). Returns the logged (loss, grad norm) per step, the final full
    parameters, and what a hook on layer 0's MLP saw (autocast on, output dtype)."""
    import transformers
    from accelerate.state import AcceleratorState

    from shardwise.integrations.transformers import ShardwiseTrainer

    AcceleratorState._reset_state(reset_partial_state=True)  # the pool's processes run many tests
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, 12, (24,), generator=g).tolist()
    data = [{"input_ids": torch.randint(0, 128, (n,), generator=g)} for n in lengths]
    world = torch.distributed.get_world_size()
    options = dict(output_dir=tmp, per_device_train_batch_size=4 // world, max_steps=STEPS, learning_rate=1e-2,
                   adam_epsilon=1e-3, max_grad_norm=0.5, logging_steps=1, report_to=[], seed=0, save_strategy="no",
                   use_cpu=True, dataloader_drop_last=True, lr_scheduler_type="constant", disable_tqdm=True)
    args = transformers.TrainingArguments(**{**options, **overrides})
    seen = []
    model.model.layers[0].mlp.register_forward_hook(
        lambda module, inputs, output: seen.append((torch.is_autocast_enabled("cpu"), str(output.dtype))))
    if kind == "plain":
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=_collate)
    else:
        sw.shard(model, strategy=kind)
        trainer = ShardwiseTrainer(model=model, args=args, train_dataset=data, data_collator=_collate)
    try:
        trainer.train()
    finally:
        torch.use_deterministic_algorithms(False)  # full_determinism=True sets it for the whole process
    logs = [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]
    params = sw.full_parameters(model) if kind != "plain" else \
        {n: p.detach().clone() for n, p in model.named_parameters()}
    return logs, params, seen[0]


# `make test` runs the rows whose fields change the arithmetic most; every row runs in `make test-all`.
FAST_ROWS = {"base", "bf16", "accumulation", "checkpointing", "adafactor"}


@pytest.mark.parametrize("row", [pytest.param(row, marks=() if row in FAST_ROWS else pytest.mark.slow)
                                 for row in sorted(ROWS)])
def test_each_honoured_field_does_what_the_plain_trainer_does(ranks, tmp_path, row):
    """Catches a TrainingArguments field accepted and ignored (bf16=True trained in fp32: the hook saw
    autocast off, losses equal to an fp32 run's) or done differently: the plain Trainer under torch
    DDP and ShardwiseTrainer (zero3) on the same 2 ranks log the same losses and grad norms and end
    with the same parameters (fp32: 1e-5; bf16: within twice the plain Trainer's own distance
    from one process, since bf16 rounds the ranks' partial sums differently)."""
    overrides = ROWS[row][0]
    (plain, plain_params, plain_seen), _ = ranks.run(_train, 2, str(tmp_path / "plain"), "plain", overrides,
                                                     timeout=240)
    (mine, params, seen), _ = ranks.run(_train, 2, str(tmp_path / "zero3"), "zero3", overrides, timeout=240)
    assert len(mine) == len(plain) == STEPS
    assert seen == plain_seen, (seen, plain_seen)
    if overrides.get("bf16"):
        assert seen == (True, "torch.bfloat16")
        (one, _, _), = ranks.run(_train, 1, str(tmp_path / "one"), "plain", overrides, timeout=240)
        tolerance = 2 * log_distance(plain, one) + 1e-6
        assert log_distance(mine, plain) <= tolerance, (mine, plain, one)
        return
    assert log_distance(mine, plain) < 1e-5 * max(1.0, max(n for _, n in plain)), (mine, plain)
    for name, value in plain_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_rows_cover_every_honoured_field():
    """Catches a field declared honoured that no row checks against the plain Trainer."""
    covered = {field for _, fields in ROWS.values() for field in fields}
    assert set(HONOURED) <= covered, set(HONOURED) - covered


def test_every_named_field_is_a_training_argument():
    """Catches a table that names a field transformers renamed (then nothing checks the real one)."""
    import transformers

    known = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    named = set(HONOURED) | {field for refusal in REFUSALS for field in refusal.fields}
    assert named <= known, named - known


_REFUSED = [("fp16", True), ("bf16_full_eval", True), ("fp16_full_eval", True), ("torch_compile", True),
            ("fsdp", ["full_shard"]), ("deepspeed", {"zero_optimization": {"stage": 3}}),
            ("parallelism_config", object()), ("use_liger_kernel", True), ("save_on_each_node", True),
            ("activation_checkpointing_kwargs", {"use_reentrant": True})]


@pytest.mark.parametrize("field, value", _REFUSED, ids=[f for f, _ in _REFUSED])
def test_fields_it_cannot_honour_are_refused_when_the_trainer_is_built(tmp_path, field, value):
    """Catches fp16=True (and the others) accepted and then ignored: refused at construction with
    the shardwise way to get it."""
    import transformers

    from shardwise.integrations.transformers import ShardwiseTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    setattr(args, field, value)  # set after __post_init__, which itself refuses some of these on CPU
    if field == "activation_checkpointing_kwargs":
        args.activation_checkpointing = True
    with pytest.raises(sw.ShardwiseError, match=field) as raised:
        ShardwiseTrainer(model=torch.nn.Linear(2, 2), args=args)
    assert next(r.fix for r in REFUSALS if field in r.fields) in str(raised.value)  # the shardwise way

"""Which `TrainingArguments` a `ShardwiseTrainer` honours, and the shardwise way to get the others.

Note [trainer arguments]: every TrainingArguments field that changes the arithmetic or the data
either does under ShardwiseTrainer what it does under the plain Trainer, or is refused when the
trainer is built, with the shardwise way to get it. Nothing is accepted and then ignored.

Honoured as the plain Trainer honours them (HONOURED below):
- bf16: the forward runs under Accelerate's bf16 autocast, outputs in fp32;
- activation_checkpointing / gradient_checkpointing (and their _kwargs): the model's own layers
  recompute (Note [recompute]); a reentrant checkpoint is refused;
- max_grad_norm (by the global norm, `sw.clip_grad_norm_`), gradient_accumulation_steps (the
  reduce skipped on all but the last micro-batch);
- the optimizer, its schedule and the loss, which the Trainer builds itself: optim, optim_args,
  learning_rate, weight_decay, adam_*, lr_scheduler_*, warmup_steps, label_smoothing_factor,
  average_tokens_across_devices (gradients are averaged over ranks, as DDP's);
- the data path, the Trainer's own: seed, data_seed, full_determinism, the batch size,
  dataloader_drop_last, train_sampling_strategy, length_column_name, remove_unused_columns,
  label_names, accelerator_config, dataloader_in_order;
- neftune_noise_alpha (a hook on the input embeddings), tf32, use_cache.

Refused (REFUSALS below, each with its fix): fp16 (`sw.shard(..., precision="fp16")`, whose loss
scaler agrees on inf/NaN across ranks), bf16_full_eval / fp16_full_eval (the Trainer would cast
the sharded model), torch_compile (compile per block after `sw.shard`), fsdp, deepspeed,
parallelism_config (a second sharding), use_liger_kernel (patch before `sw.shard`),
save_on_each_node (checkpoints need a file system every node shares).

tests/test_trainer_args.py checks each honoured row against the plain Trainer under torch DDP
on the same 2 ranks, and each refusal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shardwise.errors import ShardwiseError
from shardwise.integrations.prepared import FP16_FIX


@dataclass(frozen=True)
class Refusal:
    """A field ShardwiseTrainer cannot honour: when it is set, and the shardwise way to get it."""

    fields: tuple[str, ...]
    is_set: Callable[[object], bool]
    fix: str


def _truthy(*names: str) -> Callable[[object], bool]:
    return lambda args: any(bool(getattr(args, name, None)) for name in names)


def _reentrant(args) -> bool:
    if not getattr(args, "activation_checkpointing", False):
        return False
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        if (getattr(args, name, None) or {}).get("use_reentrant", False):
            return True
    return False


REFUSALS = (
    Refusal(("fp16",), _truthy("fp16"), FP16_FIX),
    Refusal(("bf16_full_eval", "fp16_full_eval"), _truthy("bf16_full_eval", "fp16_full_eval"),
            "the Trainer would cast the sharded model with .to(dtype) for evaluation: shard with "
            "sw.shard(..., precision=\"bf16\") instead, which computes in bf16 for training and evaluation"),
    Refusal(("torch_compile", "torch_compile_backend", "torch_compile_mode"), _truthy("torch_compile"),
            "compile after sw.shard yourself, per block (for block in model.model.layers: block.compile()), "
            "and leave torch_compile off: Accelerate would compile the model it no longer wraps"),
    Refusal(("fsdp", "fsdp_config"), _truthy("fsdp"),
            "the model is already sharded by sw.shard: leave fsdp unset (a second sharding wrapper)"),
    Refusal(("deepspeed",), _truthy("deepspeed"),
            "the model is already sharded by sw.shard: leave deepspeed unset (a second sharding wrapper)"),
    Refusal(("parallelism_config",), _truthy("parallelism_config"),
            "the model is already sharded by sw.shard: leave parallelism_config unset (sw.slice slices layers "
            "across ranks, docs/slicing.md)"),
    Refusal(("use_liger_kernel",), _truthy("use_liger_kernel"),
            "apply Liger's patch to the model before sw.shard (liger_kernel.transformers.apply_liger_kernel_to_...)"
            " and leave use_liger_kernel off"),
    Refusal(("save_on_each_node",), _truthy("save_on_each_node"),
            "every rank writes its rows into one checkpoint directory, which needs a file system all nodes "
            "share (docs/checkpoints.md): leave save_on_each_node off and put output_dir on it"),
    Refusal(("activation_checkpointing_kwargs",), _reentrant,
            "a reentrant checkpoint runs a backward inside the backward, which shardwise refuses (Note [one "
            "backward at a time]): pass {\"use_reentrant\": False}, or sw.shard(..., checkpoint_activations=True)"),
)

# Fields that change the arithmetic or the data and that ShardwiseTrainer honours as the plain
# Trainer does (Note [trainer arguments]); tests/test_trainer_args.py holds each to it.
HONOURED = (
    "bf16", "activation_checkpointing", "gradient_checkpointing", "gradient_checkpointing_kwargs",
    "activation_checkpointing_kwargs", "max_grad_norm", "gradient_accumulation_steps", "optim", "optim_args",
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "lr_scheduler_type",
    "lr_scheduler_kwargs", "warmup_steps", "seed", "data_seed", "full_determinism", "per_device_train_batch_size",
    "dataloader_drop_last", "train_sampling_strategy", "length_column_name", "remove_unused_columns",
    "label_names", "accelerator_config", "dataloader_in_order", "average_tokens_across_devices",
    "label_smoothing_factor", "neftune_noise_alpha", "tf32", "use_cache",
)


def check_training_args(args) -> None:
    """Refuse, on every rank, the TrainingArguments a ShardwiseTrainer cannot honour (Note [trainer arguments])."""
    if args is None:
        return
    refused = [refusal for refusal in REFUSALS if refusal.is_set(args)]
    if refused:
        lines = "; ".join(f"{'/'.join(r.fields)}: {r.fix}" for r in refused)
        raise ShardwiseError(f"ShardwiseTrainer cannot honour TrainingArguments({', '.join(_set(args, refused))}): "
                             f"{lines}")


def _set(args, refused) -> list[str]:
    shown = []
    for refusal in refused:
        for name in refusal.fields:
            value = getattr(args, name, None)
            if value:
                shown.append(f"{name}={value!r}" if not isinstance(value, dict) else f"{name}={{...}}")
                break
        else:
            shown.append(refusal.fields[0])
    return shown

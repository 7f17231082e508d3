"""bench/memory/max_model.py's rows for the options people turn on and DeepSpeed ZeRO-3 (issue 61, points 2 and 4):
how each is built, and each row's loss after the bench's steps against fp32 AdamW (Note [option arms]).

Note [option arms]: each option alone on plain zero3 (bf16 parameters with fp32 masters, disk offload of the
fp32 masters and optimizer state: DeepSpeed ZeRO-Infinity's route, optimizer in backward, 8-bit AdamW,
activation checkpointing), and the combinations:
- zero3_lowbit: torchao's AdamW8bit (the `lowbit` extra), its moments block-quantized to 8 bits. It steps
  whole tensors on one owner rank each (Note [low-bit state], engine/optim/lowbit.py): one process's update,
  exactly; each rank holds the 8-bit moments of the parameters it owns (about 2 of AdamW's 8 bytes per
  element, / N) and, during the step, its owned parameters and gradients whole.
- zero3_ac: checkpoint_activations=True (each block's forward recomputed in backward).
- zero3_bf16_lowbit_ac: bf16 + 8-bit AdamW + activation checkpointing.
- zero3_bf16_oib_ac: bf16 + optimizer in backward (torch AdamW) + activation checkpointing.
- zero3_bf16_oib_lowbit_ac: all four: bf16 + optimizer in backward + 8-bit AdamW + activation
  checkpointing, each unit's parameters stepped whole on their owners inside backward (Note [whole step per
  unit], engine/optim/whole_step.py): the update is 8-bit AdamW's after backward, bitwise; per rank about
  4/N bytes of fp32 values and 2/N of 8-bit moments a parameter, and one unit's gradients at a time.
- ds_zero3: DeepSpeed ZeRO-3 (the bench extra), built under `deepspeed.zero.Init` (its equivalent of
  sw.deferred_init: no rank holds the whole model), fp32 AdamW, `stage3_param_persistence_threshold: 0`,
  DS_ACCELERATOR=cpu, as bench/speed/deepspeed_arms.py; unavailable with the reason where deepspeed is not.
  Its first init compiles a shared-memory op under ~/.cache/torch_extensions; an init killed while compiling
  (a probe's timeout) leaves that folder's `lock` behind, and every later init waits on it: delete it.
The estimator's figure for each row is sw.estimate's with the row's options (`estimate_options`: the 8-bit
optimizer, optimizer in backward, checkpointing, disk offload); DeepSpeed's and FSDP2's plain zero3's.

The loss column: each row's model at one fixed depth (--loss-layers, default 8), the bench's data, seed and
steps, unbudgeted, against fp32 AdamW under plain zero3 at the same depth (`zero3`): the final step's loss,
averaged over ranks, and its difference. Not at each row's maximum depth: fp32 AdamW does not fit there, which
is the point of the row. The pipeline rows are left out (their sampler feeds other batches). A bf16 row's loss
is the bf16 model's output, rounded to bf16 (about 0.03 at a loss of 7): its column says little below that.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import torch

# config: (label, estimator strategy, precision, disk offload), as max_model.CONFIGS
OPTION_CONFIGS = {
    "zero3_kept": ("shardwise zero3, comm buffers kept between steps", "zero3", "fp32", False),
    "zero3_bf16": ("shardwise zero3 + bf16", "zero3", "bf16", False),
    "zero3_offload": ("shardwise zero3 + disk offload", "zero3", "fp32", True),
    "zero3_oib": ("shardwise zero3 + optimizer in backward", "zero3", "fp32", False),
    "zero3_bf16_oib": ("shardwise zero3 + bf16 + optimizer in backward", "zero3", "bf16", False),
    "zero3_lowbit": ("shardwise zero3 + 8-bit AdamW (torchao)", "zero3", "fp32", False),
    "zero3_ac": ("shardwise zero3 + activation checkpointing", "zero3", "fp32", False),
    "zero3_bf16_oib_ac": ("shardwise zero3 + bf16 + optimizer in backward + act. ckpt", "zero3", "bf16", False),
    "zero3_bf16_lowbit_ac": ("shardwise zero3 + bf16 + 8-bit AdamW + act. ckpt", "zero3", "bf16", False),
    "zero3_bf16_oib_lowbit_ac": ("shardwise zero3 + bf16 + optimizer in backward + 8-bit AdamW + act. ckpt", "zero3",
                                 "bf16", False),
    "ds_zero3": ("DeepSpeed ZeRO-3", "zero3", "fp32", False),
}
# (low-bit optimizer, activation checkpointing, optimizer in backward) per shardwise option row
_OPTIONS = {"zero3_kept": (False, False, False),
            "zero3_bf16": (False, False, False), "zero3_offload": (False, False, False),
            "zero3_oib": (False, False, True), "zero3_bf16_oib": (False, False, True),
            "zero3_lowbit": (True, False, False), "zero3_ac": (False, True, False),
            "zero3_bf16_oib_ac": (False, True, True), "zero3_bf16_lowbit_ac": (True, True, False),
            "zero3_bf16_oib_lowbit_ac": (True, True, True)}
# Rows whose comm pool is kept between steps (sw.shard(keep_comm_buffers=True), Note [lean tail]): its memory price
KEPT_BUFFERS = {"zero3_kept"}


def estimate_options(config: str) -> dict:
    """sw.estimate's keyword arguments for `config`'s options: the optimizer (torchao's 8-bit AdamW: Note [low-bit
    estimate], estimate/lowbit_bytes.py), optimizer in backward (Note [gradients stepped in backward],
    estimate/core.py) and activation checkpointing."""
    lowbit, checkpointed, in_backward = _OPTIONS.get(config, (False, False, False))
    return {"optimizer": "adamw8bit" if lowbit else "adamw", "checkpoint_activations": checkpointed,
            "optimizer_in_backward": in_backward, "keep_comm_buffers": config in KEPT_BUFFERS}


# `make setup` installs torchao beside the venv, not in it (the Makefile says why): the low-bit rows' ranks get it
# on their path.
LOWBIT_SITE = Path(__file__).resolve().parents[2] / ".lowbit"


def unavailable(config: str) -> str | None:
    """Why `config` cannot run here (its library is not installed), or None."""
    if _OPTIONS.get(config, (False,))[0] and importlib.util.find_spec("torchao") is None \
            and not (LOWBIT_SITE / "torchao").is_dir():
        return "torchao is not installed (the lowbit extra: pip install -e '.[lowbit]' -c constraints.txt)"
    if config == "ds_zero3":
        from bench.speed.deepspeed_arms import unavailable as ds_unavailable

        return ds_unavailable()
    return None


def env(config: str) -> dict[str, str]:
    """Environment the launcher adds for `config`'s ranks."""
    if config == "ds_zero3":
        return {"DS_ACCELERATOR": "cpu"}
    if _OPTIONS.get(config, (False,))[0] and (LOWBIT_SITE / "torchao").is_dir():
        return {"PYTHONPATH": os.pathsep.join(filter(None, [str(LOWBIT_SITE), os.environ.get("PYTHONPATH")]))}
    return {}


def build_option(args, cfg, config: str, rank: int, adamw: dict):
    """(the callable to train, its optimizer, how the model was built) for an option row, per Note [option arms];
    DeepSpeed's is a step function with no optimizer (its engine steps), as the pipeline rows'."""
    import shardwise as sw
    from shardwise.models.gpt import GPT, Block

    if config == "ds_zero3":
        return _build_deepspeed(args, cfg, rank, adamw)
    lowbit, checkpointed, in_backward = _OPTIONS[config]
    _, strategy, precision, offload = OPTION_CONFIGS[config]
    with sw.deferred_init():
        model = GPT(cfg)
    options = {"offload": f"disk:{args.offload_dir}/rank{rank}"} if offload else {}
    sw.shard(model, strategy=strategy, units=Block, precision=precision, checkpoint_activations=checkpointed,
             keep_comm_buffers=config in KEPT_BUFFERS, **options)
    if lowbit:
        import torchao.optim

        optimizer = torchao.optim.AdamW8bit(model.parameters(), **adamw)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)
    if in_backward:
        sw.optimizer_in_backward(model, optimizer)
    return model, optimizer, "deferred"


def build_fsdp2(cfg, world_size: int, adamw: dict):
    """FSDP2's row (Note [init] in max_model.py): fully_shard per Block, then the root, on meta, to_empty, and
    the GPT's init on each rank's local shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardwise.models.gpt import GPT

    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # root last: embeddings, tied head, ln_f
    model.to_empty(device="cpu")
    with torch.no_grad():  # the GPT's init, on each rank's local shard
        for name, param in model.named_parameters():
            local = param.to_local()
            if name.endswith("bias"):
                local.zero_()
            elif ".ln_" in name or name.startswith("ln_f"):
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02)
    return model, torch.optim.AdamW(model.parameters(), **adamw), "meta + to_empty"


def _build_deepspeed(args, cfg, rank: int, adamw: dict):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from shardwise.models.gpt import GPT

    ds_config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                 "gradient_clipping": 0.0, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                 "fp16": {"enabled": False}, "bf16": {"enabled": False}, "steps_per_print": 10**9,
                 "wall_clock_breakdown": False}
    with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=torch.float32):
        model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), **adamw)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                           dist_init_required=False)
    gen = torch.Generator().manual_seed(1000 + rank)  # the worker loop's data, drawn the same way

    def step() -> float:
        tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=gen)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step, None, "deepspeed.zero.Init"


def loss_at_depth(args, config: str, probe) -> dict:
    """Note [option arms]: `config`'s losses at --loss-layers blocks, unbudgeted (`probe` is max_model.probe)."""
    unbudgeted = copy.copy(args)
    unbudgeted.budget_bytes, unbudgeted.kill_at = 2**50, 1.0
    result = probe(unbudgeted, config, args.loss_layers)
    ranks = result.get("ranks", [])
    if result.get("verdict") != "fits" or not ranks:
        return {"layers": args.loss_layers, "error": result.get("error", result.get("verdict"))}
    losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(ranks[0]["losses"]))]
    return {"layers": args.loss_layers, "losses": losses}


def attach_loss_reference(rows: list[dict], reference: dict) -> None:
    """fp32 AdamW's losses (plain zero3 at the same depth) kept in each row measured at that depth, so a
    report rewritten from the JSON (--report, --merge) compares with the losses the run measured."""
    for row in rows:
        loss = row.get("loss_at_depth")
        if loss and "losses" in reference and loss["layers"] == reference["layers"]:
            loss["reference"] = reference["losses"]


def loss_lines(rows: list[dict], args) -> list[str]:
    """The report's loss table: each row's final loss at --loss-layers against fp32 AdamW (zero3)."""
    shown = [row for row in rows if row.get("loss_at_depth")]
    if not shown:
        return []
    layers = shown[0]["loss_at_depth"]["layers"]
    lines = ["", f"Loss after {args.steps} steps at {layers} blocks (Note [option arms], "
                 "bench/memory/max_model_options.py: every row at one depth, unbudgeted, the bench's data and seed), "
                 "against fp32 AdamW under plain zero3:", "",
             "| config | final loss | − fp32 AdamW | relative |", "|---|---:|---:|---:|"]
    for row in shown:
        loss = row["loss_at_depth"]
        if "losses" not in loss:
            lines.append(f"| {row['label']} | failed: {str(loss.get('error'))[:60]} | | |")
            continue
        final, reference = loss["losses"][-1], loss.get("reference")
        if reference:
            delta = final - reference[-1]
            lines.append(f"| {row['label']} | {final:.6f} | {delta:+.2e} | {delta / reference[-1]:+.2e} |")
        else:
            lines.append(f"| {row['label']} | {final:.6f} | — | — |")
    return lines

"""DeepSpeed ZeRO 1/2/3 as arms of bench/speed/strategies.py: the same GPT, data, seed and fp32 AdamW.

DeepSpeed 0.19.8 runs on CPU with the pinned torch (`pip install -e '.[bench]' -c constraints.txt`,
with DS_BUILD_OPS=0 so nothing is compiled at install time). The launcher sets
DS_ACCELERATOR=cpu for these arms; the first `deepspeed.initialize` compiles a small
shared-memory op with g++ (about a minute, then cached under ~/.cache/torch_extensions).
Each arm passes an ordinary `torch.optim.AdamW` with the other arms' hyper-parameters,
no gradient clipping and no accumulation (as the other arms), and ZeRO-3 gets
`stage3_param_persistence_threshold: 0` so that every parameter, however small, is sharded.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil

import torch

CONFIGS = ("ds_zero1", "ds_zero2", "ds_zero3")
LABELS = {c: f"DeepSpeed ZeRO-{c[-1]}" for c in CONFIGS}
FORMULA = {"ds_zero1": (8, 8), "ds_zero2": (4, 12), "ds_zero3": (0, 16)}  # as bench/speed/strategies.py's FORMULA
TESTED_VERSION = "0.19.8"


def unavailable() -> str | None:
    """Why the DeepSpeed arms cannot run on this machine, or None (deepspeed is not imported here)."""
    if importlib.util.find_spec("deepspeed") is None:
        return ("deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8 -c constraints.txt, "
                "or the bench extra)")
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "no C++ compiler (g++): DeepSpeed's first init on CPU compiles its shared-memory op"
    return None


def version() -> str | None:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def env() -> dict[str, str]:
    """Environment the launcher adds for a DeepSpeed arm."""
    return {"DS_ACCELERATOR": "cpu"}


def initialize(model: torch.nn.Module, config: str, args):
    """`deepspeed.initialize` on `model` for arm `config`; returns (engine, DeepSpeed's optimizer)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    stage = int(config[-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,  # as the other arms: one backward per step
        "gradient_clipping": 0.0,  # the other arms do not clip
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    # The process group is shardwise's (sw.init(), gloo): DeepSpeed wraps the one that exists.
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                                      dist_init_required=False)
    return engine, ds_optimizer


def train_step(engine, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One step as DeepSpeed wants it: the engine's backward and step (which also zeroes grads)."""
    loss = engine(idx, targets)
    engine.backward(loss)
    engine.step()
    return loss


def state_tensors(model: torch.nn.Module, ds_optimizer):
    """Every tensor DeepSpeed holds for model state: each parameter's partition (`ds_tensor` under
    ZeRO-3) and whatever its optimizer keeps in attributes (flat fp32 partitions, gradient
    partitions and buckets, the inner AdamW's moments), two containers deep."""
    for param in model.parameters():
        for held in (getattr(param, "ds_tensor", None), param.grad):
            if isinstance(held, torch.Tensor):
                yield held
    inner = getattr(ds_optimizer, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    for value in vars(ds_optimizer).values():
        yield from _tensors_in(value, depth=3)


def _tensors_in(value, depth: int):
    if isinstance(value, torch.Tensor):
        yield value
    elif depth and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth - 1)
    elif depth and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth - 1)

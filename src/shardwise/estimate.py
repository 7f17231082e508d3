"""`sw.estimate`: what one rank will hold for a training job, before anything is built.

The model-state figures follow the engine's own buffers (flat_unit.py), unit by unit,
padding included, so they are the bytes `memory.model_state_bytes` counts after
`optimizer.step()` and before `zero_grad()` (tests/test_estimate.py holds every
strategy × precision to 5%). With m the master dtype's bytes (4: fp32), c the compute
dtype's, r the reduce dtype's, and per unit S = this rank's padded elements and
F = N·S the padded full size (t: trainable parameters only):

| strategy | parameters           | gradients                          | optimizer (AdamW) |
|----------|----------------------|------------------------------------|-------------------|
| ddp      | m·P                  | m·P (the all-reduce buckets)       | 2m·P              |
| zero1    | c·F (+ m·S if c ≠ m) | r·F (shard grads view their rows)  | 2m·S_t            |
| zero2    | c·F (+ m·S if c ≠ m) | r·S_t (the reduce-scatter output)  | 2m·S_t            |
| zero3    | m·S                  | r·S_t                              | 2m·S_t            |

plus 4 bytes per trainable tensor for AdamW's `step` counter and one float per
trainable tensor for the "used" flag riding in each reduce-scatter (Note [unused params]).
With `offload="disk:PATH"` (zero3) the fp32 master shards and the optimizer's
param-sized state live in memory-mapped files: they are reported as `offloaded`, not
resident; the step pages in one unit's masters and state at a time (offload.py), which
counts with the transient buffers.

Note [transient buffers]: `gather_buffers` is what a step holds only while it runs,
besides activations. zero3: the root unit (gathered for the whole forward), at most two
other units gathered, one more in flight (its all-gather receive buffer), all in c
bytes; in backward also one unit's full gradients from autograd (c·F), the root's
(the tied head's gradient waits there for the embedding's) and one packed reduce
input (r·F: one reduce in flight, _zero.py's _MAX_PENDING_REDUCES). zero1/zero2 keep
their full parameters, so only the two in-flight re-gathers and the same backward
buffers count. ddp: autograd's copy of the
largest parameter's gradient before it lands in its bucket.

Note [activations]: for `shardwise.models.gpt.GPT` with B sequences of T tokens per
rank, width D, L blocks, vocabulary V, in the compute dtype's c bytes:
    activations = c · B · T · (16.5·D·L + 2·D + 3·V)
16.5·D per block is what autograd saves (LayerNorm inputs, the qkv output, attention
output and its re-layout, the MLP's 4·D input and GELU output: measured 16.4·D at fp32
and bf16 with `saved_tensors_hooks`), 2·D the final LayerNorm, 3·V the logits, their
log-softmax and its gradient at the start of backward. With `checkpoint_activations` a
block keeps only its input (D) and one block at a time is recomputed in backward: its
16.5·D plus the gradients its backward makes, 36·D in all (measured), so
    activations = c · B · T · (D·L + 36·D + 2·D + 3·V).
Calibrated against peak RSS with MALLOC_MMAP_THRESHOLD_=65536 (tests/test_estimate.py
checks both within 25%).

Note [peak]: `total` is the predicted peak RSS of a rank. ddp and zero1 keep their
gradient buffers across steps, so gradients and activations add up. zero2/zero3 create
each unit's gradient shard in backward, just as that unit's activations are freed, and
`zero_grad()` drops them, so at any moment the two together are at most the larger of
the two: the peak counts max(gradients, activations). Checked against bench/max_model.py's
measured peaks (within 5% at every probe of its 2 GiB run, offload included).

`runtime` is Python + torch + shardwise + a gloo process group: 270 MiB of RSS per rank
right after `sw.init()`, and about 60 MiB more once steps run (malloc arenas of small
blocks, oneDNN scratch, gloo's buffers, autograd's graph), so 330 MiB per rank (224 MiB
for one process without a group): torch 2.13 CPU, fitted on bench/max_model.py's probes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.precision import MixedPrecision, resolve_precision
from shardwise.units import UnitSpec, build_units

MIB = 2**20
RUNTIME_BYTES = 330 * MIB  # one rank: Python + torch + shardwise + gloo group (module docstring)
RUNTIME_BYTES_SINGLE = 224 * MIB  # one process, no process group
_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
# Optimizer state per trainable element, in units of the master dtype's bytes, and bytes per tensor.
_OPTIMIZERS = {"adamw": (2, 4), "adam": (2, 4), "sgd": (0, 0), "sgd_momentum": (1, 0)}
_ACT_PER_BLOCK = 16.5  # saved elements per token per block, in units of D (Note [activations])
_ACT_RECOMPUTE = 36  # checkpointed: one block recomputed in backward, in units of D
_ACT_LOGITS = 3  # logits, log-softmax, and the logits' gradient, in units of V


@dataclass(frozen=True)
class _Unit:
    """One unit's sizes at a world size (elements; `shard` = S is one rank's padded rows)."""

    shard: int
    full: int  # N·S
    trainable_shard: int
    trainable_full: int
    num_trainable: int  # trainable tensors
    largest: int  # largest single tensor (elements)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds, by kind. `total` is the predicted peak RSS of a rank."""

    strategy: str
    world_size: int
    precision: str
    optimizer: str
    offload: str | None
    num_params: int
    parameters: int
    gradients: int
    optimizer_state: int
    gather_buffers: int  # Note [transient buffers]
    activations: int  # Note [activations]; 0 when no batch was given
    runtime: int
    offloaded: int = 0  # in memory-mapped files, not resident
    notes: tuple[str, ...] = field(default_factory=tuple)
    gradients_kept: bool = True  # Note [peak]: False when gradients exist only from backward to zero_grad

    @property
    def model_state(self) -> int:
        """Parameters + gradients + optimizer state: what `memory.model_state_bytes` counts."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> int:
        """The predicted peak RSS of a rank (Note [peak])."""
        if self.gradients_kept:
            grads_and_activations = self.gradients + self.activations
        else:
            grads_and_activations = max(self.gradients, self.activations)
        return (self.parameters + self.optimizer_state + grads_and_activations + self.gather_buffers
                + self.runtime)

    @property
    def label(self) -> str:
        parts = [self.strategy] + ([self.precision] if self.precision != "fp32" else [])
        return "+".join(parts + (["offload"] if self.offload else []))

    def rows(self) -> list[tuple[str, int]]:
        return [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state), ("gather/reduce buffers", self.gather_buffers),
                ("activations", self.activations), ("runtime (Python + torch)", self.runtime),
                ("total per rank", self.total)]

    def __str__(self) -> str:
        head = (f"{self.label}: {self.num_params / 1e6:.1f}M parameters, world size {self.world_size}, "
                f"{self.optimizer}" + (f", offload {self.offload}" if self.offload else ""))
        lines = [head, f"  {'per rank':<26}{'MiB':>12}"]
        for name, value in self.rows():
            if name == "total per rank":
                lines.append("  " + "-" * 38)
                name = "peak per rank"
            lines.append(f"  {name:<26}{value / MIB:>12,.1f}")
        if not self.gradients_kept and self.activations:
            lines.append("  (gradient shards appear in backward as activations go: the peak counts the larger)")
        if self.offloaded:
            lines.append(f"  {'in files (not resident)':<26}{self.offloaded / MIB:>12,.1f}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def estimate(
    model_or_num_params: nn.Module | int,
    strategy: str,
    world_size: int,
    precision: str | MixedPrecision = "fp32",
    optimizer: str = "adamw",
    offload: str | None = None,
    batch: int | None = None,
    seq: int | None = None,
    *,
    units: UnitSpec = None,
    unit_params: int | None = None,
    num_layers: int | None = None,
    config=None,
    checkpoint_activations: bool = False,
    runtime: int | None = None,
) -> MemoryEstimate:
    """Predict what one rank holds for `strategy` at `world_size`, by kind (see module docstring).

    `model_or_num_params`: a model (build it under `torch.device("meta")`: only shapes are
    read) or a parameter count. A model is cut into units as `shard(units=...)` would; a
    count is cut into `num_layers` equal units, or units of `unit_params`, else treated as
    one unit (conservative for zero3). `precision`: "fp32" | "bf16" | "fp16" | a
    `MixedPrecision`. `optimizer`: "adamw" | "adam" | "sgd" | "sgd_momentum".
    `offload`: None or "disk:PATH". `batch`, `seq`: sequences per rank and tokens per
    sequence, for activations; they need a GPT model or `config=GPTConfig(...)`.
    `checkpoint_activations`: as `shard(checkpoint_activations=True)` (zero strategies).
    `runtime`: bytes of Python + torch per rank (default: measured, see RUNTIME_BYTES).
    """
    if strategy not in _STRATEGIES:
        raise ShardwiseError(f"strategy={strategy!r} is not one of {_STRATEGIES}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ShardwiseError(f"world_size={world_size!r} must be a positive int")
    if optimizer not in _OPTIMIZERS:
        raise ShardwiseError(f"optimizer={optimizer!r} is not one of {sorted(_OPTIMIZERS)}")
    policy = resolve_precision(precision)
    precision_name = precision if isinstance(precision, str) else _name_of(policy)
    if strategy == "ddp" and policy.param_dtype != torch.float32:
        raise ShardwiseError("precision is a zero-strategy option; with strategy='ddp' use torch.autocast "
                             "around the forward (and estimate it as fp32)")
    if checkpoint_activations and strategy == "ddp":
        raise ShardwiseError("checkpoint_activations needs units: use a zero strategy")
    if offload is not None and strategy != "zero3":
        raise ShardwiseError(f"offload needs strategy='zero3' ({strategy} keeps full parameters in memory, "
                             "which is most of what offload would move)")
    if offload is not None and not (isinstance(offload, str) and offload.startswith("disk:") and len(offload) > 5):
        raise ShardwiseError(f"offload={offload!r} is not understood: use None or 'disk:PATH'")

    notes: list[str] = []
    layout_size = 1 if strategy == "ddp" else world_size  # ddp holds whole, unpadded tensors
    if isinstance(model_or_num_params, nn.Module):
        model = model_or_num_params
        plan_units = _units_of_model(model, units, layout_size)
        num_params = sum(p.numel() for p in model.parameters())
        master = _master_bytes(model)
        config = config if config is not None else getattr(model, "cfg", None)
    else:
        num_params = int(model_or_num_params)
        plan_units = _units_of_count(num_params, layout_size, unit_params, num_layers, notes)
        master = 4
    c = torch.empty(0, dtype=policy.param_dtype).element_size()
    r = torch.empty(0, dtype=policy.reduce_dtype).element_size()
    state_per_elem, state_per_tensor = _OPTIMIZERS[optimizer]

    if strategy == "ddp":
        real, trainable = sum(u.full for u in plan_units), sum(u.trainable_full for u in plan_units)
        num_tensors = sum(u.num_trainable for u in plan_units)
        parameters, gradients = master * real, master * trainable
        optimizer_state = state_per_elem * master * trainable + state_per_tensor * num_tensors
        gather = master * max(u.largest for u in plan_units)
        offloaded = 0
    else:
        parameters, gradients, optimizer_state, offloaded = _zero_state(
            plan_units, strategy, master, c, r, state_per_elem, state_per_tensor, offload is not None)
        gather = _zero_transient(plan_units, strategy, c, r)
    if offload is not None:
        # The optimizer steps one unit at a time: that unit's masters and state are paged in.
        gather += (1 + state_per_elem) * master * max(u.shard for u in plan_units)
        notes.append("fp32 master shards and optimizer state in memory-mapped files under "
                     f"{offload[len('disk:'):]}; the step pages in one unit at a time")

    activations = 0
    if batch is not None:
        activations = _gpt_activations(config, batch, seq, c, checkpoint_activations)
    if runtime is None:
        runtime = RUNTIME_BYTES if world_size > 1 else RUNTIME_BYTES_SINGLE
    return MemoryEstimate(strategy, world_size, precision_name, optimizer, offload, num_params,
                          parameters, gradients, optimizer_state, gather, activations, runtime,
                          offloaded, tuple(notes), gradients_kept=strategy in ("ddp", "zero1"))


def _name_of(policy: MixedPrecision) -> str:
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return names.get(policy.param_dtype, str(policy.param_dtype))


def _master_bytes(model: nn.Module) -> int:
    floats = [p for p in model.parameters() if p.is_floating_point()]
    return floats[0].element_size() if floats else 4


def _units_of_model(model: nn.Module, units: UnitSpec, world_size: int) -> list[_Unit]:
    """The model's units as shard() cuts them, sized with dim-0 padding (flat_unit._layout)."""
    out = []
    for plan in build_units(model, units):
        shard = full = t_shard = t_full = num_trainable = largest = 0
        for owned in plan.params:
            shape = owned.param.shape
            rows = shape[0] if len(shape) else 1
            row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
            s = math.ceil(rows / world_size) * row_numel
            shard, full = shard + s, full + world_size * s
            largest = max(largest, owned.param.numel())
            if owned.param.requires_grad:
                t_shard, t_full, num_trainable = t_shard + s, t_full + world_size * s, num_trainable + 1
        out.append(_Unit(shard, full, t_shard, t_full, num_trainable, largest))
    return out


def _units_of_count(num_params: int, world_size: int, unit_params: int | None, num_layers: int | None,
                    notes: list[str]) -> list[_Unit]:
    """Equal units for a bare parameter count (no padding: shapes are unknown)."""
    if unit_params is None and num_layers:
        unit_params = num_params // num_layers
    if unit_params is None or unit_params >= num_params:
        notes.append("a bare parameter count is one unit: pass unit_params= or num_layers= for zero3's "
                     "gather buffers")
        sizes = [num_params]
    else:
        sizes = [num_params - unit_params * (num_params // unit_params)] + [unit_params] * (num_params // unit_params)

    def unit(n: int) -> _Unit:
        s = math.ceil(n / world_size)
        # One tensor per unit: the `step` counters and flags are per tensor and are small.
        return _Unit(s, world_size * s, s, world_size * s, 1 if n else 0, n)

    return [unit(n) for n in sizes]


def _zero_state(plan_units, strategy, m, c, r, state_per_elem, state_per_tensor, offload):
    """(parameters, gradients, optimizer state, offloaded) for zero1/2/3 (module docstring table)."""
    keep_full = strategy in ("zero1", "zero2")
    parameters = gradients = optimizer_state = offloaded = 0
    for u in plan_units:
        masters = m * u.shard
        # zero1/2 at c == m: the shards are views of the kept full buffer (flat_unit.aliased).
        aliased = keep_full and c == m
        if keep_full:
            parameters += c * u.full
        if not aliased:
            if offload:
                offloaded += masters
            else:
                parameters += masters
        # Param-sized state goes to the files; Adam's `step` counters stay in memory.
        state = state_per_elem * m * u.trainable_shard
        optimizer_state += state_per_tensor * u.num_trainable
        if offload:
            offloaded += state
        else:
            optimizer_state += state
        if not u.num_trainable:
            continue
        # The reduce-scatter output: this rank's rows plus one "used" flag per tensor. The shard
        # grads are views of it when r == m, else fp32 copies and the output is freed.
        reduced = r * (u.trainable_shard + u.num_trainable) if r == m else m * u.trainable_shard
        if strategy == "zero1":
            # Full grads kept (over the whole unit); shard grads are views of them when r == m.
            gradients += r * u.full + (0 if r == m else reduced)
        else:
            gradients += reduced
    return parameters, gradients, optimizer_state, offloaded


def _zero_transient(plan_units, strategy, c, r) -> int:
    """Note [transient buffers]."""
    root, others = plan_units[0], plan_units[1:] or plan_units[:1]
    biggest = max(u.full for u in others)
    backward = c * biggest + c * root.full + r * biggest  # unit grads, root grads, the packed reduce
    if strategy == "zero3":
        return c * root.full + 3 * c * biggest + backward
    return 2 * c * biggest + backward  # zero1/2: two re-gathers in flight


def _gpt_activations(config, batch: int, seq: int | None, c: int, checkpointed: bool = False) -> int:
    """Note [activations]."""
    needed = ("d_model", "n_layers", "vocab_size")
    if config is None or not all(hasattr(config, name) for name in needed):
        raise ShardwiseError("activations need a GPT's sizes: pass a shardwise.models.gpt.GPT model or "
                             "config=GPTConfig(...), or leave batch=None")
    seq = seq if seq is not None else config.seq_len
    d, layers, vocab = config.d_model, config.n_layers, config.vocab_size
    # Both constants were measured at mlp_ratio 4, where the MLP's share is 8·D.
    mlp_change = 8 * getattr(config, "mlp_ratio", 4) / 4 - 8
    if checkpointed:
        per_token = d * layers + (_ACT_RECOMPUTE + mlp_change) * d + 2 * d + _ACT_LOGITS * vocab
    else:
        per_token = (_ACT_PER_BLOCK + mlp_change) * d * layers + 2 * d + _ACT_LOGITS * vocab
    return int(c * batch * seq * per_token)


# ---- planning ----------------------------------------------------------------------

# Cheapest first: each step down the list communicates more (zero3 gathers parameters
# twice per step, 1.5x ddp's volume), computes in lower precision, or waits on a disk.
PLAN_ORDER = (("ddp", "fp32", False), ("zero1", "fp32", False), ("zero2", "fp32", False),
              ("zero3", "fp32", False), ("zero3", "bf16", False), ("zero3", "fp32", True),
              ("zero3", "bf16", True))


@dataclass(frozen=True)
class PlanOption:
    """One configuration the planner weighed: its estimate, whether it fits, and why not."""

    strategy: str
    precision: str
    offload: str | None
    estimate: MemoryEstimate | None  # None when the configuration is not available
    fits: bool
    reason: str  # why it does not fit (or is not available); "" when it fits

    @property
    def label(self) -> str:
        parts = [self.strategy] + ([self.precision] if self.precision != "fp32" else [])
        return "+".join(parts + (["offload"] if self.offload else []))


def offload_available() -> bool:
    """Whether this version's `sw.shard` takes `offload=`."""
    import inspect

    from shardwise.strategies import shard

    return "offload" in inspect.signature(shard).parameters


def plan(model_or_num_params: nn.Module | int, memory: int, world_size: int, *, optimizer: str = "adamw",
         batch: int | None = None, seq: int | None = None, offload_dir: str = "/tmp/shardwise-offload",
         checkpoint_activations: bool = False, **estimate_kwargs) -> list[PlanOption]:
    """Weigh every configuration in PLAN_ORDER against `memory` bytes per rank.

    The first option with `fits` is the cheapest that fits; each other says why not.
    `checkpoint_activations` applies to the zero options (ddp has no units to recompute).
    Extra keyword arguments go to `estimate` (units=, unit_params=, config=, runtime=).
    """
    options = []
    has_offload = offload_available()
    for strategy, precision, offloaded in PLAN_ORDER:
        offload = f"disk:{offload_dir}" if offloaded else None
        if offloaded and not has_offload:
            options.append(PlanOption(strategy, precision, offload, None, False,
                                      "not available: this version's sw.shard has no offload="))
            continue
        est = estimate(model_or_num_params, strategy, world_size, precision, optimizer, offload, batch, seq,
                       checkpoint_activations=checkpoint_activations and strategy != "ddp", **estimate_kwargs)
        fits = est.total <= memory
        options.append(PlanOption(strategy, precision, offload, est, fits, "" if fits else _why_not(est, memory)))
    return options


def _why_not(est: MemoryEstimate, memory: int) -> str:
    over = est.total - memory
    parts = sorted(est.rows()[:-1], key=lambda row: row[1], reverse=True)
    name, largest = parts[0]
    text = f"{_gib(est.total)} > {_gib(memory)} by {_gib(over)}; largest: {name} {_gib(largest)}"
    floor = est.activations + est.runtime
    if floor > memory:
        text += f" (activations + runtime alone need {_gib(floor)}: lower the batch or checkpoint activations)"
    return text


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"

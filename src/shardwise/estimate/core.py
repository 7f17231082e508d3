"""`sw.estimate`: what one rank will hold for a training job, before anything is built.

The model-state figures follow the engine's own buffers (engine/unit/flat_unit.py), unit by unit,
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
trainable tensor for the "used" flag riding in each reduce-scatter (Note [unused params]), and 26 KiB per parameter
tensor for what no element count sees (`tensor_objects`: Note [per-tensor objects] in estimate/objects.py).
torchao's low-bit AdamW (`optimizer="adamw8bit"`, `"adamw4bit"`) is counted per tensor instead: quantized or
fp32 state by torchao's rule, each parameter's whole state on its owner rank under zero1/2/3 (the busiest rank's
counted), every rank all of it under ddp, plus the owner's buffers at the step (`step_buffers`) and torchao's
runtime (`optimizer_runtime`): Note [low-bit estimate] in estimate/lowbit_bytes.py.
With `offload="disk:PATH"` (zero3) the fp32 master shards and the optimizer's
param-sized state live in memory-mapped files: they are reported as `offloaded`, not
resident; the step pages in one unit's masters and state at a time (engine/memory/offload.py), which
counts with the transient buffers. With `offload="host"` (zero1/2/3) the master rows (m·S), their
gradients (m·S_t) and the optimizer state live in host memory: reported as `host`, apart from the
device's parameters (zero1/zero2's kept c·F), gradients (zero1's kept r·F) and optimizer state (none);
`total` counts both, the memory of a CPU run (estimate/zero_bytes.py, memory/host_offload.py).

Note [transient buffers]: `gather_buffers` is what a step holds only while it runs,
besides activations. zero3: the root unit (gathered for the whole forward), at most two
other units gathered, one more in flight (its all-gather receive buffer), all in c
bytes; in backward also one unit's full gradients from autograd (c·F), the root's
(the tied head's gradient waits there for the embedding's) and one packed reduce
input (r·F over the largest unit, the root included: one reduce in flight,
engine/schedule/reducer.py's MAX_PENDING_REDUCES, and the root's is the last) with its receive
buffer (r·F more: gloo's all-to-all form, Note [gloo collectives]; NCCL's reduce-scatter
needs 1/N of it, so there this counts up to one unit's gradients too many; zero1's kept
gradients are that input already, Note [kept gradients rank-major], so only the receive
buffer counts; a unit with frozen parameters packs its trainable ones apart, one input
more than counted). zero1/zero2 keep
their full parameters, so only the two in-flight re-gathers (their receive buffers: NCCL's
form; gloo's lands large parameters in place, Note [gathered in place], so there this is an
upper bound) and the same backward buffers count. ddp: autograd's copy of the
largest parameter's gradient before it lands in its bucket. When the probe measured the
activations (Note [activations]), the backward's gradient buffers are left out (and ddp's
copy): the probe's peak, at the start of backward, already holds the gradients autograd makes
there (the head's, one unit's); only the gathered parameters come on top. Measured in
bench/estimate/estimator.py: a zero3 step's peak exceeds the probe's by 13-18 MiB where the root plus
three units come to 17-20 MiB, and the backward term would add 15-20 MiB more. The engine's comm pool
keeps the reduce's buffers and zero3's freed units between steps (Note [reused buffers], bound
`comm_buffer_bytes`), so the reduce in flight counts with the probe too. hpZ's chunks and compression's
wire buffers: Note [comm option bytes] (comm_options.py).

Note [gradients stepped in backward]: with `optimizer_in_backward=True` (sw.optimizer_in_backward, zero2/zero3)
each unit is stepped as its reduce lands and its gradient shard freed (engine/optim/step_in_backward.py), so the
r·S_t rows of the table never all exist: `gradients` is the largest unit's reduced gradient (the root's
included), the one being stepped while the next reduce is in flight (that reduce's buffers are the comm pool's,
counted already). zero1 keeps its full gradients across steps whatever steps them, and offload="host" copies
each reduced gradient to host memory (`host`): their rows are unchanged; ddp has no optimizer_in_backward
(refused). A low-bit optimizer's owners then gather, step and scatter one unit's owned parameters at a time
inside backward: the largest unit's owner buffers count in `gather_buffers`, none at a step after backward
(Note [low-bit estimate]).

Note [activations]: with `batch=`, a model's activations are measured by the probe
(estimate/probe.py, Note [activation probe]): one forward + backward on meta tensors in the
compute dtype, its peak bytes besides parameters, at exactly this batch and seq; inputs from
`inputs=` or, for Hugging Face models, from their config (estimate/inputs.py). A model (or
`config=`) that implements `activation_bytes(batch, seq, dtype_bytes, checkpointed)`
(shardwise.interfaces.ActivationSized) is sized by that formula instead, unless `inputs=` is
given or the model makes its own inputs (shardwise.interfaces.ExampleInputs, as the zoo GPT
does: its formula was within 25% of measured, the probe is exact); a bare parameter count
needs such a `config=`.
With `checkpoint_activations=True` the probe checkpoints the same units the engine does (every
unit but the root) and measures the recomputing step: forward keeps each unit's inputs, backward
holds one unit's recomputed activations at a time (Note [probed recompute] in probe.py).

Note [peak]: `total` is the predicted peak RSS of a rank. ddp and zero1 keep their
gradient buffers across steps, so gradients and activations add up. zero2/zero3 create
each unit's gradient shard in backward, just as that unit's activations are freed, and
`zero_grad()` drops them, so at any moment the two together are at most the larger of
the two: the peak counts max(gradients, activations). Checked against bench/memory/max_model.py's
measured peaks (within 5% at every probe of its 2 GiB run, offload included). The optimizer's step comes
after backward, activations gone: it holds every gradient, zero1/zero2's comm pool (never trimmed, Note
[lean tail]) and, for an optimizer stepped on whole tensors, the owner's buffers (`step_buffers`); the
peak counts the larger of that phase and the backward's (the step's is the smaller without `step_buffers`).

`runtime` is Python + torch + shardwise + a gloo process group: 270 MiB of RSS per rank
right after `sw.init()`, and about 60 MiB more once steps run (malloc arenas of small
blocks, oneDNN scratch, gloo's buffers, autograd's graph), so 330 MiB per rank (224 MiB
for one process without a group): torch 2.13 CPU, fitted on bench/memory/max_model.py's probes.

Note [allocator]: every figure above is peak RSS with MALLOC_MMAP_THRESHOLD_=65536, the environment
the estimate was fitted in: glibc's malloc then returns each freed block of 64 KiB or more to the
system at once. Under glibc's default threshold (which grows with the blocks freed) freed blocks stay
resident (zero3's gathered units, the step's temporaries), and the same run peaked 16-30% above the
plan (bench/estimate/plan_followed.py --malloc both: zero2 planned 704 MiB, 698 measured with the setting, 912
without; issue 44: zero3+bf16+offload planned 957 MiB, measured 1111; zero2 1216, measured 1450). That
retention depends on the order of frees, not on the model's sizes, so it is not modelled: `sw.init()`
puts every rank in the fitted environment itself (Note [allocator at init] in allocator.py: glibc's
`mallopt`, unless the variable is set), `shardwise plan` says so on its `run:` line, and
bench/estimate/plan_followed.py `--malloc both` measures the chosen row both ways.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.config import DiskOffload, MixedPrecision, ShardConfig, config_label
from shardwise.engine.compat import unwrap_compiled
from shardwise.engine.unit.stage import policy_of
from shardwise.engine.unit.units import UnitSpec, build_units
from shardwise.errors import ShardwiseError
from shardwise.estimate.comm_options import gather_note, secondary_bytes
from shardwise.estimate.inputs import InputMaker
from shardwise.estimate.lowbit_bytes import (
    LOW_BIT,
    OFFLOAD_NOT_MODELLED,
    lowbit_terms,
    tensors_of_count,
    tensors_of_model,
)
from shardwise.estimate.objects import tensor_object_bytes
from shardwise.estimate.probe import formula_activations, probe_activations
from shardwise.estimate.zero_bytes import (
    comm_pool_bytes,
    stepped_gradient_bytes,
    units_of_count,
    units_of_model,
    zero_state,
    zero_transient,
)
from shardwise.interfaces import ActivationSized, ExampleInputs

MIB = 2**20
RUNTIME_BYTES = 330 * MIB  # one rank: Python + torch + shardwise + gloo group (module docstring)
RUNTIME_BYTES_SINGLE = 224 * MIB  # one process, no process group
STEP_ROW = "whole-step buffers"  # MemoryEstimate.rows(): an owner's gathers at the step, after backward
POOL_ROW = "comm buffer pool"  # MemoryEstimate.rows(): the part of the gather/reduce buffers the comm pool lends
# Optimizer state per trainable element, in units of the master dtype's bytes, and bytes per tensor; the low-bit
# ones' state is counted per tensor by torchao's rules instead (Note [low-bit estimate], lowbit_bytes.py).
_OPTIMIZERS = {"adamw": (2, 4), "adam": (2, 4), "sgd": (0, 0), "sgd_momentum": (1, 0), "adamw8bit": (0, 0),
               "adamw4bit": (0, 0)}
OPTIMIZERS = tuple(_OPTIMIZERS)  # the names `optimizer=` takes (the CLI's --optimizer choices)


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
    secondary: int = 0  # hpZ's chunks, forward to backward (Note [comm option bytes], comm_options.py)
    host: int = 0  # offload="host": masters, their gradients, optimizer state in host memory (not the device's)
    comm_pool: int = 0  # of gather_buffers: the comm pool's bound (Note [reused buffers], Note [lean tail])
    pool_kept: bool = True  # kept between steps: zero1/zero2, zero3 with keep_comm_buffers (Note [lean tail])
    step_buffers: int = 0  # a whole-tensor step's owner buffers, after backward (Note [low-bit estimate])
    optimizer_runtime: int = 0  # torchao's import and compiled step (Note [low-bit estimate])
    tensor_objects: int = 0  # each parameter tensor's objects beyond its elements (Note [per-tensor objects])

    @property
    def model_state(self) -> int:
        """Parameters + gradients + optimizer state on the compute device: what `memory.model_state_bytes`
        counts, less `host` (offload="host")."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> int:
        """The predicted peak RSS of a rank (Note [peak])."""
        if self.gradients_kept:
            grads_and_activations = self.gradients + self.activations
        else:
            grads_and_activations = max(self.gradients, self.activations)
        backward = grads_and_activations + self.gather_buffers
        # The step after backward: activations gone, every gradient there; zero1/zero2 keep their pool, zero3 where
        # asked (Note [lean tail]). Never more than `backward` unless a whole-tensor step gathers (step_buffers).
        step = self.gradients + self.step_buffers + (self.comm_pool if self.pool_kept else 0)
        return (self.parameters + self.optimizer_state + max(backward, step) + self.secondary + self.host
                + self.runtime + self.optimizer_runtime + self.tensor_objects)

    @property
    def label(self) -> str:
        return config_label(self.strategy, self.precision, bool(self.offload))

    def rows(self) -> list[tuple[str, int]]:
        return [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state), ("gather/reduce buffers", self.gather_buffers),
                *([(POOL_ROW, self.comm_pool)] if self.comm_pool else []),
                *([(STEP_ROW, self.step_buffers)] if self.step_buffers else []),
                *([("hpZ secondary chunks", self.secondary)] if self.secondary else []),
                ("activations", self.activations),
                *([("host memory (offload)", self.host)] if self.host else []),
                ("per-tensor objects", self.tensor_objects), ("runtime (Python + torch)", self.runtime),
                *([("optimizer runtime (torchao)", self.optimizer_runtime)] if self.optimizer_runtime else []),
                ("total per rank", self.total)]

    def __str__(self) -> str:
        head = (f"{self.label}: {self.num_params / 1e6:.1f}M parameters, world size {self.world_size}, "
                f"{self.optimizer}" + (f", offload {self.offload}" if self.offload else ""))
        lines = [head, f"  {'per rank':<26}{'MiB':>12}"]
        for name, value in self.rows():
            if name == "total per rank":
                lines.append("  " + "-" * 38)
                name = "peak per rank"
            if name == POOL_ROW:  # a part of the row above (indented), not added to the peak again
                name = "  " + name
            lines.append(f"  {name:<26}{value / MIB:>12,.1f}")
        if not self.gradients_kept and self.activations:
            lines.append("  (gradient shards appear in backward as activations go: the peak counts the larger)")
        if self.step_buffers:
            lines.append(f"  ({STEP_ROW}: held at the step after backward, activations gone: the peak counts the "
                         "larger phase)")
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
    units: UnitSpec = "auto",
    unit_params: int | None = None,
    num_layers: int | None = None,
    config=None,
    checkpoint_activations: bool = False,
    runtime: int | None = None,
    inputs: InputMaker | None = None,
    reshard_after_forward: bool | int = True,
    compression=None,
    prefetch: int | None = None,
    optimizer_in_backward: bool = False,
    keep_comm_buffers: bool = False,
) -> MemoryEstimate:
    """Predict what one rank holds for `strategy` at `world_size`, by kind (see module docstring).

    `model_or_num_params`: a model (build it under `torch.device("meta")`: only shapes are
    read) or a parameter count. A model is cut into units as `shard(units=...)` would; a
    count is cut into `num_layers` equal units, or units of `unit_params`, else treated as
    one unit (conservative for zero3). `precision`: "fp32" | "bf16" | "fp16" | a
    `MixedPrecision`. `optimizer`: "adamw" | "adam" | "sgd" | "sgd_momentum" | "adamw8bit" | "adamw4bit" (torchao's
    low-bit AdamW, stepped on whole tensors by owner ranks: Note [low-bit estimate]; no offload).
    `offload`: None, "host" (counted as `host`) or "disk:PATH". `batch`, `seq`: sequences per rank and tokens per
    sequence (samples per rank; seq None: the model's own length), for activations (Note
    [activations]): a model's are measured by the probe, a count's need `config=`.
    `checkpoint_activations`: as `shard(checkpoint_activations=True)` (zero strategies).
    `runtime`: bytes of Python + torch per rank (default: measured, see RUNTIME_BYTES).
    `inputs`: `(batch, seq, device) -> the model's inputs` for the activation probe (Note
    [activations]); Hugging Face models need none. `reshard_after_forward`, `compression`: as shard()'s (hpZ's
    chunks and the wire buffers, Note [comm option bytes] in comm_options.py); `prefetch`: as shard()'s (zero3's
    gathers in flight, each one more unit's full values, Note [prefetch depth]); `keep_comm_buffers`: as shard()'s
    (zero3's pool kept between steps, and what it adds at backward's tail, Note [kept tail] in zero_bytes.py).
    `optimizer_in_backward`: as
    `sw.optimizer_in_backward(model, optimizer)` (zero2/zero3): one unit's reduced gradients at a time (Note
    [gradients stepped in backward]).
    """
    # The same rules as shard(), from the same place (shardwise/config.py).
    shard_config = ShardConfig.of(strategy, precision=precision, offload=offload,
                                  checkpoint_activations=checkpoint_activations,
                                  reshard_after_forward=reshard_after_forward, compression=compression,
                                  prefetch=prefetch, keep_comm_buffers=keep_comm_buffers)
    policy, offload = shard_config.precision, shard_config.offload
    pool_kept = strategy != "zero3" or keep_comm_buffers  # Note [lean tail]: zero3's is released at the tail
    precision_name = precision if isinstance(precision, str) else policy.label
    if not isinstance(world_size, int) or world_size < 1:
        raise ShardwiseError(f"world_size={world_size!r} must be a positive int")
    if optimizer_in_backward and strategy == "ddp":
        raise ShardwiseError("optimizer_in_backward=True with strategy='ddp': sw.optimizer_in_backward steps zero1/"
                             "zero2/zero3 units only; pick one of those or drop optimizer_in_backward")
    if optimizer not in _OPTIMIZERS:
        raise ShardwiseError(f"optimizer={optimizer!r} is not one of {sorted(_OPTIMIZERS)}")
    if optimizer in LOW_BIT and offload is not None:
        raise ShardwiseError(f"optimizer={optimizer!r} with offload={offload.spec!r}: {OFFLOAD_NOT_MODELLED}. Drop "
                             "offload, or estimate optimizer='adamw' with it")

    notes: list[str] = []
    layout_size = 1 if strategy == "ddp" else world_size  # ddp holds whole, unpadded tensors
    if isinstance(model_or_num_params, nn.Module):
        model = model_or_num_params = unwrap_compiled(model_or_num_params)  # the compiled handle too
        plan_units = units_of_model(model, units, layout_size)
        num_params = sum(p.numel() for p in model.parameters())
        master = _master_bytes(model)
        config = config if config is not None else model
    else:
        num_params = int(model_or_num_params)
        plan_units = units_of_count(num_params, layout_size, unit_params, num_layers, notes)
        master = 4
    c = torch.empty(0, dtype=policy.param_dtype).element_size()
    r = torch.empty(0, dtype=policy.reduce_dtype).element_size()
    state_per_elem, state_per_tensor = _OPTIMIZERS[optimizer]
    low_bit = None
    if optimizer in LOW_BIT:  # Note [low-bit estimate]
        is_model = isinstance(model_or_num_params, nn.Module)
        tensors = tensors_of_model(model_or_num_params, units, layout_size) if is_model else tensors_of_count(
            plan_units)
        copies = strategy in ("zero1", "zero2") and c == master  # the owner copies its kept full values
        low_bit = lowbit_terms(tensors, strategy, world_size, optimizer, master, copies, not is_model,
                               optimizer_in_backward)
        notes += low_bit.notes

    secondary = 0 if strategy == "ddp" else secondary_bytes([u.full for u in plan_units[1:]], c, reshard_after_forward)
    probed = batch is not None and isinstance(model_or_num_params, nn.Module) and (
        inputs is not None or isinstance(model_or_num_params, ExampleInputs)
        or not isinstance(config, ActivationSized))  # Note [activations]
    if strategy == "ddp":
        real, trainable = sum(u.full for u in plan_units), sum(u.trainable_full for u in plan_units)
        num_tensors = sum(u.num_trainable for u in plan_units)
        parameters, gradients = master * real, master * trainable
        optimizer_state = state_per_elem * master * trainable + state_per_tensor * num_tensors
        gather = 0 if probed else master * max(u.largest for u in plan_units)  # Note [transient buffers]
        offloaded, host, gradients_kept, comm_pool = 0, 0, True, 0
    else:
        parameters, gradients, optimizer_state, offloaded, host = zero_state(
            plan_units, shard_config, master, c, r, state_per_elem, state_per_tensor)
        gather = zero_transient(plan_units, shard_config, c, r, layout_size, with_backward=not probed)
        if low_bit is not None and optimizer_in_backward:  # one unit's owned wholes at a time, in backward
            gather += low_bit.in_backward_buffers
        comm_pool = comm_pool_bytes(plan_units, shard_config, c, r, layout_size)
        gradients_kept = policy_of(strategy).kept_grads(True) is not None  # zero1 keeps its full gradients (any value)
        if optimizer_in_backward and not (gradients_kept or host):  # Note [gradients stepped in backward]
            gradients = stepped_gradient_bytes(plan_units, shard_config, master, r)
            notes.append("optimizer in backward: one unit's reduced gradients at a time")
    if gather:
        in_flight = 0 if strategy == "ddp" else policy_of(strategy, shard_config.prefetch).gathers_in_flight
        notes.append(gather_note(strategy, probed, batch is None, gradients_kept, in_flight, kept_pool=pool_kept))
    if host:
        notes.append("offload='host': fp32 master rows, their gradients and the optimizer state in host memory "
                     "(`host`); the compute device holds the rest")
    if isinstance(offload, DiskOffload):
        # The optimizer steps one unit at a time: that unit's masters and state are paged in.
        gather += (1 + state_per_elem) * master * max(u.shard for u in plan_units)
        notes.append("fp32 master shards and optimizer state in memory-mapped files under "
                     f"{offload.path}; the step pages in one unit at a time")

    activations = 0
    if batch is None:
        notes.append("activations not counted: pass batch= (--batch)")
    elif probed:
        recompute = tuple(plan.module for plan in build_units(model_or_num_params, units)[1:]) \
            if checkpoint_activations else ()
        activations = _probed(model_or_num_params, batch, seq, policy.param_dtype, inputs, recompute, notes)
    else:
        activations = formula_activations(config, batch, seq, c, checkpoint_activations)
    if runtime is None:
        runtime = RUNTIME_BYTES if world_size > 1 else RUNTIME_BYTES_SINGLE
    step_buffers = optimizer_runtime = 0
    if low_bit is not None:
        optimizer_state += max(low_bit.state_by_rank)
        step_buffers = 0 if optimizer_in_backward else low_bit.step_buffers
        optimizer_runtime = low_bit.runtime
    return MemoryEstimate(strategy, world_size, precision_name, optimizer, offload and offload.spec, num_params,
                          parameters, gradients, optimizer_state, gather, activations, runtime,
                          offloaded, tuple(notes), gradients_kept=gradients_kept, secondary=secondary, host=host,
                          comm_pool=comm_pool, pool_kept=pool_kept,
                          step_buffers=step_buffers, optimizer_runtime=optimizer_runtime,
                          tensor_objects=tensor_object_bytes(sum(u.num_tensors for u in plan_units)))


def _master_bytes(model: nn.Module) -> int:
    floats = [p for p in model.parameters() if p.is_floating_point()]
    return floats[0].element_size() if floats else 4


def _probed(model: nn.Module, batch: int, seq: int | None, dtype: torch.dtype, inputs,
            recompute: tuple[nn.Module, ...], notes: list[str]) -> int:
    """Note [activations]: the probe's peak; with `recompute` (the units checkpoint_activations
    checkpoints), of the checkpointed step (Note [probed recompute] in probe.py)."""
    probe = probe_activations(model, batch, seq, dtype=dtype, inputs=inputs, recompute=recompute)
    where = "on meta tensors" if probe.device == "meta" else "on CPU at micro-batches 1 and 2, extrapolated"
    notes.append(f"activations: the peak of one forward + backward at batch {batch}"
                 + (f", seq {seq}" if seq is not None else "") + f", measured {where}"
                 + (f", each of the {len(recompute)} units recomputed in backward (checkpoint_activations)"
                    if recompute else ""))
    return probe.peak


"""`sw.load`: match names, check everything, then write into the model, its optimizer state,
scheduler, stateful objects and RNGs (save.py's docstring has the format).

Note [validate, then apply]: a load runs in two phases with an agreement of every rank between
them. `plan_load` (load_plan.py) checks all that a load can refuse and writes nothing: names and
shapes, optimizer groups and the type of every saved setting against the current one, object
and scheduler states decoded, the RNG states tried on throwaway generators, and every chunk of
every row this rank will read (its crc, `Source.verify`). Only when every rank's plan succeeded
does any rank apply it: keyword objects and the scheduler first (their own `load_state_dict`
may still refuse; another agreement follows), then the model's rows, the optimizer state and
the RNGs, whose every byte was checked. So a refused load leaves the model and the optimizer as
they were, on every rank. The rows are read once and not held twice in memory: the checks run
over a map of each file, and the apply reads each row once with `pread` into the model and checks
the crc of exactly the bytes it read before the next window (Note [checked where applied] in
mapped.py). So a file changed between the phases, by any route (`cp` over it, a shared writable
map of dirty pages that leaves its times alone, a truncation), is an error naming it, and no byte
that failed its crc stays in the model: the rows applied before it were checked, and the error
says the model holds part of the load.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.checkpoint.format.names import Rename, make_renamer
from shardwise.checkpoint.format.optim_state import named_optimizers
from shardwise.checkpoint.format.ranks import all_gather_object, group_of
from shardwise.checkpoint.format.values import from_json, restore_rng
from shardwise.checkpoint.read.load_plan import LoadJob, LoadPlan, plan_load
from shardwise.checkpoint.read.report import LoadReport
from shardwise.checkpoint.read.sources import open_source
from shardwise.engine.optim.lowbit import unflatten_state
from shardwise.engine.protocol import slicing_of
from shardwise.engine.unit.info import row_view
from shardwise.errors import ShardwiseError


def load(path, model: nn.Module, optim=None, scheduler=None, *,
         strict: bool = True, rename: Rename = None, restore_rng: bool | None = None,
         **objects) -> LoadReport:
    """Load a checkpoint into `model` (and `optim`, `scheduler`) in place; every rank calls it.

    `path` is a checkpoint directory, a Hugging Face model directory (`model.safetensors`, or the
    files `model.safetensors.index.json` names; the index itself may be given), a single
    `.safetensors` file (an export, a hub model) or a `torch.save`d state dict (read with
    `weights_only=True`). A Hugging Face file's names are matched as `from_pretrained` matches
    them (transformers' key renames, the base-model prefix added or dropped, tied weights stored
    once); a tensor stored in another dtype than the model's is converted (the report's notes
    say which). Any strategy
    and world size loads any checkpoint: each rank reads only the rows it holds.
    Names are matched after stripping wrapper prefixes (`module.`, `_orig_mod.`,
    `_fsdp_wrapped_module.`) on both sides and applying `rename` to the checkpoint's
    names (a dict of exact names, or a list of `(regex, replacement)` pairs).

    `strict=True` raises a ShardwiseError carrying the report when anything is missing,
    unexpected or shaped differently, before changing anything; `strict=False` loads
    what matches (fine-tuning a new head) and returns the report (`print(report)`).
    A damaged checkpoint is refused before anything changes (Note [validate, then apply]).
    `optim` is what `sw.save` was given: one optimizer, a list in the same order, or a dict under
    the same names; another number of optimizers, or another class, is refused.
    RNG states are restored when resuming (`optim` given, same world size) unless
    `restore_rng` says otherwise. Objects passed as keywords (`sampler=...`) get the
    state saved under the same keyword.
    """
    optimizers, form = named_optimizers(optim)
    slicing = slicing_of(model)  # sliced by sw.slice: load whole tensors (Note [unsliced view])
    if slicing is not None:
        if form in ("list", "dict"):
            raise ShardwiseError("a sliced model (sw.slice) checkpoints one optimizer: build one optimizer over "
                                 "every parameter")
        view = slicing.checkpoint_view(model, optimizers[0][1] if optimizers else None, fill=False)
        report = load(path, view.model, view.optim, scheduler, strict=strict, rename=rename,
                      restore_rng=restore_rng, **objects)
        view.write_back()
        return report
    return load_view(path, model, None, optim, scheduler, strict=strict, rename=rename, restore_rng=restore_rng,
                     objects=objects)


def load_view(path, model: nn.Module, infos, optim=None, scheduler=None, *, strict: bool = True,
              rename: Rename = None, restore_rng: bool | None = None, objects=None) -> LoadReport:
    """`load` into `model` filling the rows `infos` names (None: `shard_info(model)`'s): a pipeline's
    stage adds the whole frozen prefix every rank holds to its shards (pipeline/checkpoint/)."""
    optimizers, form = named_optimizers(optim)
    agreed = _agreement(path, model)
    source, plan = None, None
    try:
        with agreed:
            source = open_source(path, make_renamer(rename), model)
            plan = plan_load(LoadJob(source, model, optimizers, form, scheduler, objects or {}, strict, restore_rng,
                                     agreed.rank, agreed.world, infos))
        with agreed:
            _apply_states(plan)
        with agreed:
            _apply_tensors(plan)
    finally:
        if source is not None:
            source.close()
    return plan.report


class _agreement:
    """The agreement points of a load, over the ranks that hold `model`: a rank that failed inside one makes
    every rank raise, and none hangs."""

    def __init__(self, path, model: nn.Module):
        self.path = path
        self.group, self.rank, self.world = group_of(model)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if error is not None and not isinstance(error, Exception):
            return False  # KeyboardInterrupt, SystemExit: no agreement, the process is going
        messages = all_gather_object(None if error is None else str(error), self.group, self.world)
        if error is not None:
            return False  # re-raised as it is
        failed = [(r, message) for r, message in enumerate(messages) if message is not None]
        if failed:
            raise ShardwiseError(f"rank {failed[0][0]} could not load {self.path}: {failed[0][1]}")
        return False


def _apply_states(plan: LoadPlan) -> None:
    """Keyword objects and the scheduler: their own load_state_dict may refuse the state."""
    origin = plan.job.source.values_file
    for key, state in plan.object_states.items():
        _call_load_state_dict(plan.job.objects[key], state, f"{origin}: {key}=")
    if plan.scheduler_state is not None:
        _call_load_state_dict(plan.job.scheduler, plan.scheduler_state, f"{origin}: scheduler")


def _call_load_state_dict(obj, state, what: str) -> None:
    try:
        obj.load_state_dict(state)
    except Exception as error:  # noqa: BLE001 - the object's own code: any type
        raise ShardwiseError(f"{what}: {type(obj).__name__}.load_state_dict refused the saved state "
                             f"({type(error).__name__}: {error}); the model and optimizer were not changed") from None


def _apply_tensors(plan: LoadPlan) -> None:
    """The model's rows, the optimizer state and the RNGs, every byte of them already checked."""
    try:
        _write_tensors(plan)
    except ShardwiseError as error:
        raise ShardwiseError(f"{error}. It changed after the load verified it (rewritten in place or truncated "
                             "while the load ran): the model holds part of the checkpoint now, every byte of it "
                             "checked (the rows that failed were zeroed); load it again once nothing writes it "
                             "(Note [validate, then apply])") from None
    if plan.rng is not None:
        restore_rng(*plan.rng)
        plan.report.rng_restored = True


def _write_tensors(plan: LoadPlan) -> None:
    report = plan.report
    with torch.no_grad():
        for name, tensor, lo, hi, dest in plan.reads:
            _read_into(tensor, lo, hi, dest)
            report.loaded.append(name)
        for load in plan.optimizers:
            for group, settings in zip(load.optim.param_groups, load.settings or ()):
                group.update(settings)
            for param, scalars, reads, device in load.states:
                if scalars is None:
                    load.optim.state.pop(param, None)  # none in the checkpoint, or another rank's: as fresh
                    continue
                new = {key: from_json(value, device) for key, value in scalars.items()}
                current = load.optim.state.get(param, {})
                for read in reads:
                    lo, hi = read.info.row_start, read.info.row_end
                    buffer = _state_buffer(current.get(read.key), read, param.device)
                    _read_into(read.source, lo, hi, row_view(buffer, read.info, lo, hi))
                    new[read.key] = buffer
                load.optim.state[param] = unflatten_state(new, load.prototypes.get(id(param)))


def _state_buffer(current, read, device) -> torch.Tensor:
    """The tensor an optimizer state read fills: the state tensor the optimizer holds when it has the
    same shape, dtype and device (loaded in place, as the parameters are: a fresh buffer page-faults
    all of its memory, which cost a load more than its reads), else a new one; zeros outside the rows."""
    if (isinstance(current, torch.Tensor) and current.shape == read.shape and current.dtype == read.dtype
            and current.device == torch.device(device) and current.is_contiguous()):
        if row_view(current, read.info, read.info.row_start, read.info.row_end).numel() != current.numel():
            current.zero_()  # padding rows: as a new buffer would have them
        return current
    return torch.zeros(read.shape, dtype=read.dtype, device=device)


def _read_into(tensor, lo: int, hi: int, dest: torch.Tensor) -> None:
    """Rows lo:hi of a source tensor into `dest` (a view of a parameter, buffer or state)."""
    direct = dest if dest.device.type == "cpu" and dest.is_contiguous() else None
    rows = tensor.read(lo, hi, direct)
    if rows is dest:
        # pread wrote the memory behind autograd's back: bump the version counter, which is
        # how zero1/zero2 notice that their full parameters must be re-gathered.
        torch.autograd.graph.increment_version(dest)
    else:
        dest.copy_(rows.reshape(dest.shape))

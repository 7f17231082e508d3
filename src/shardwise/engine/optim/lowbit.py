"""Low-bit optimizer state (torchao's `AdamW8bit`, `AdamW4bit`, `AdamWFp8`): how a step sees it and how a
checkpoint holds it.
Uses: nothing of the engine.

Note [low-bit state]: torchao keeps AdamW's moments as tensor subclasses (`OptimState8bit`, ...) of
codes (uint8, the parameter's shape or half of it), one fp32 scale per block of the *flattened* tensor
(256 elements for 8-bit, 128 for 4-bit) and a code map; and it quantizes a state only for a tensor of at
least 4096 elements that the block size divides (`_AdamBase._new_buffer`), keeping fp32 otherwise. Rows of
a shard are another tensor to both rules: a 128 x 32 matrix is quantized whole, its 64 x 32 rows at 2 ranks
are kept in fp32, and rows whose count the block does not divide would be refused or blocked across
other elements. So these classes are not in `_ELEMENTWISE` (whole_step.py) and step as every class
shardwise does not know as elementwise does: on whole tensors, one owner rank per parameter (Note
[whole-tensor step]). The update is then one process's by construction, bitwise at every world size for
the same reduced gradients (tests/test_lowbit_optim.py), and each parameter's state lives on its owner
only, the owners balanced by elements: per rank about 1/N of one process's state (a matrix's state is not
split, so the largest one is the grain). Rows aligned to the quantizer's blocks were the other way: they
split the state evenly, but only where every rank's rows hold a multiple of the block and at least
4096 elements, and elsewhere they would change which tensors are quantized; not exact in general.
For the same reason `sw.optimizer_in_backward` steps these classes whole too, each unit's parameters on
their owners as the unit's gradient lands (Note [whole step per unit], whole_step.py), never its rows: the
update is the step after backward's, and the gradients of one unit live at a time. On CPU torchao compiles its step
(torch.compile): importing it and the first compiled step add about 170 MiB of RSS per process (measured:
218 -> 303 MiB at import, 387 MiB after the first step, 419 MiB peak), a constant that a deep model's saved
state (6 of AdamW's 8 bytes per element, / N) must outweigh before it fits more (bench/memory/max_model.py).

Checkpoints store the plain tensors a subclass is made of (`flatten_state`: `exp_avg.codes`,
`exp_avg.scale`, `exp_avg.qmap`), never the subclass (safetensors holds plain tensors, and no pickle). On
load the loading optimizer's own class says what they are made back into (`unflatten_state`, from a
prototype state of its dry step: Note [optimizer class] in checkpoint/format/optim_state.py), so a
checkpoint never names a class to construct. The parts are whole records of the owner's state, so
any world size loads them onto the parameter's owner there.
"""

from __future__ import annotations

from torch import Tensor

from shardwise.errors import ShardwiseError

# Libraries whose optimizers keep block-quantized state (Note [low-bit state]): their update of a row reads
# its block's scale, so no row step matches theirs, whatever a caller vouches for.
_QUANTIZING = ("torchao.", "bitsandbytes.")


def quantizes_state(optimizer) -> bool:
    """Whether `optimizer` keeps block-quantized state: a torchao or bitsandbytes class, or a state tensor
    already made of quantized parts."""
    if any(base.__module__.startswith(_QUANTIZING) for base in type(optimizer).__mro__):
        return True
    return any(is_composite(value) for state in optimizer.state.values() for value in state.values())


def is_composite(value) -> bool:
    """A tensor subclass made of plain tensors (torch's `__tensor_flatten__` protocol): a quantized state."""
    return isinstance(value, Tensor) and type(value) is not Tensor and hasattr(value, "__tensor_flatten__")


def flatten_state(state: dict, where: str) -> dict:
    """One parameter's optimizer state with each composite tensor replaced by its plain parts, keyed
    `<key>.<part>` (Note [low-bit state]); the state itself when it holds none."""
    if not any(is_composite(value) for value in state.values()):
        return state
    flat = {}
    for key, value in state.items():
        if not is_composite(value):
            flat[key] = value
            continue
        names, _ = value.__tensor_flatten__()
        for name in names:
            part = getattr(value, name)
            if type(part) is not Tensor:
                raise ShardwiseError(
                    f"optimizer state {key!r} of {where} is a {type(value).__name__} whose part {name!r} is a "
                    f"{type(part).__name__}, not a plain tensor: a checkpoint stores plain tensors only. Use an "
                    "optimizer whose state is plain tensors or one level of quantized parts (torchao's AdamW8bit, "
                    "AdamW4bit, AdamWFp8), or save the model alone (sw.save(path, model)).")
            flat[f"{key}.{name}"] = part
    return flat


def composite_parts(prototype: dict) -> dict[str, list[str]]:
    """For each composite state key of a prototype state, the keys of its parts as `flatten_state` names them."""
    return {key: [f"{key}.{name}" for name in value.__tensor_flatten__()[0]]
            for key, value in prototype.items() if is_composite(value)}


def check_parts(prototype: dict | None, saved_keys, where: str) -> None:
    """Refuse a saved state whose keys are not made as the loading class's state is: parts where it keeps
    a plain tensor, or a plain tensor (or other parts) where it keeps a quantized one (an fp32 state loaded
    into a low-bit optimizer, another block size that quantizes other tensors, another library version)."""
    if prototype is None:
        return
    saved_keys = set(saved_keys)
    for key, value in prototype.items():
        if not isinstance(value, Tensor):
            continue
        held = sorted(k for k in saved_keys if k == key or k.startswith(f"{key}."))
        wanted = composite_parts({key: value}).get(key, [key])
        if held and held != sorted(wanted):
            kept = f"a {type(value).__name__} made of {wanted}" if is_composite(value) else "a plain tensor"
            raise ShardwiseError(
                f"{where}: the loading optimizer keeps {key!r} as {kept}, and the checkpoint holds {held}: it "
                "was saved by an optimizer built otherwise (another block size) or another version of its "
                "library (Note [low-bit state]). Build the optimizer the checkpoint was saved with, or load the "
                "model alone (sw.load(path, model)) and start the optimizer fresh.")


def unflatten_state(state: dict, prototype: dict | None) -> dict:
    """`flatten_state` undone: each composite key of the loading class's `prototype` state made back, of
    the parts loaded, into the prototype's type with the prototype's attributes (Note [low-bit state])."""
    if not prototype:
        return state
    built = dict(state)
    for key, parts in composite_parts(prototype).items():
        kind, (names, attributes) = type(prototype[key]), prototype[key].__tensor_flatten__()
        inner = {name: built.pop(part) for name, part in zip(names, parts)}
        built[key] = kind.__tensor_unflatten__(inner, attributes, prototype[key].size(), prototype[key].stride())
    return built

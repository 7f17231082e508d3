"""torch internals the engine relies on, in one place; tests/test_compat.py fails loudly when
a torch release changes one of them (STYLE.md: lean on torch's internals in one place).
Uses: nothing of the engine.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import sys

import torch
import torch.utils.checkpoint

from shardwise.errors import ShardwiseError

_GRAD_CALL = "autograd.grad"

# The C setters of Tensor.data and Tensor.grad: they rebind a Parameter's storage (and shape) while
# keeping the Python object an optimizer holds, and bypass ShardParameter's own properties.
set_data = torch._C.TensorBase.data.__set__
get_grad, set_grad = torch._C.TensorBase.grad.__get__, torch._C.TensorBase.grad.__set__

# A reentrant activation checkpoint's nested backward runs in this code object (window.py,
# Note [one backward at a time]).
REENTRANT_BACKWARD = torch.utils.checkpoint.CheckpointFunction.backward.__code__


def in_reentrant_backward() -> bool:
    """Whether the caller runs inside a reentrant checkpoint's nested backward (its frames are on
    the call stack). Walks the stack: call it where that happens once per unit, not per tensor."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is REENTRANT_BACKWARD:
            return True
        frame = frame.f_back
    return False

# What torch's DistributedDataParallel reads first when it is built (guards.py, Note [no second
# wrapper]) and which parameters it leaves alone (ddp.py, host-shared weights).
DDP_IGNORE_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"


# Note [compiled]: `torch.compile` of a sharded model (whole, or each unit with `module.compile()`
# before or after `shard()`) traces the model's math and none of the engine. The engine's module
# hooks gather, agree across ranks, install full views and open autograd windows: host-side work
# with Python state and collectives that dynamo cannot trace (traced, the version-counter read of a
# ShardParameter recursed until a RecursionError). Each hook is therefore wrapped in
# `outside_graph`: dynamo breaks the graph there, runs the hook eagerly (about 2.5 us of wrapper
# per call) and traces on; the full views the hook installs reach the graph as ordinary inputs
# (guarded by shape, dtype and stride, the same each step, so nothing recompiles after the first
# step), and their gradients leave it into GatherUnit's backward as in eager mode. Breaks per
# forward: one before and one after each unit, and one before and after each module of the root
# unit (an embedding, the final norm, the head: Note [outer calls] in zero.py); the zoo GPT (two
# blocks) runs 5 graphs per forward (torch DDP: 1). Compiling per
# unit breaks only at the units' own hooks. A checkpointed unit (Note [recompute]) is recomputed by
# the compiled graph from the views it saved; zero3 refills their storage before that backward.
outside_graph = torch.compiler.disable


def unwrap_compiled(model):
    """The module `torch.compile(module)` wrapped (its `OptimizedModule` keeps it as `_orig_mod`), else
    `model`: every sw.* function that takes a model takes the compiled handle too (`model =
    torch.compile(model)`, torchtitan's and the HF docs' reassignment), and asks about the module the
    engine was attached to. Judged by the class torch defines, so a user module with an `_orig_mod`
    attribute is left alone."""
    kind = type(model)
    if kind.__name__ == "OptimizedModule" and kind.__module__ == "torch._dynamo.eval_frame":
        return model._orig_mod
    return model

# Inside a tensor subclass's __torch_function__ (ShardParameter, RowsGrad, the host copy's
# parameters): run torch's own behaviour, plain tensors out.
plain_tensors = torch._C.DisableTorchFunctionSubclass

def allow_foreach(tensor_type: type) -> None:
    """Let torch's optimizers (and its foreach utilities) take their multi-tensor kernels for parameters
    of `tensor_type`, as torch/distributed/tensor registers DTensor: both check a parameter's exact
    type against these lists, and any other subclass falls back to a Python loop over tensors (on
    CUDA, one kernel launch per tensor per op; on CPU torch picks the loop for every type)."""
    import torch.optim.optimizer as optim_module  # `as`: torch.optim deletes the attribute
    import torch.utils._foreach_utils as foreach_utils

    for supported in (optim_module._foreach_supported_types, foreach_utils._foreach_supported_types):
        if tensor_type not in supported:
            supported.append(tensor_type)


def chunk_cat(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each tensor cut into `num_chunks` padded chunks along dim 0, concatenated chunk by chunk:
    a (num_chunks, sum of chunk sizes) tensor in one kernel (collectives.pack), written into `out` if given."""
    if out is None:
        return torch._chunk_cat(tensors, dim=0, num_chunks=num_chunks)
    return torch._chunk_cat(tensors, dim=0, num_chunks=num_chunks, out=out)


def swap_storage_memory(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory (and sizes) of two storages; every tensor keeps its own storage object. How a
    zero3 unit's freed full values go to the comm pool and come back without a new allocation (Note
    [reused buffers], comm/buffers.py): views autograd saved of the unit's storage see the refilled memory,
    as they do after FSDP2's `resize_`. torch's private `UntypedStorage._swap_data_ptr_`."""
    a._swap_data_ptr_(b)


# Refilling a freed unit's storage without bumping the version counters autograd saved
# (flat_unit.py, Note [version counters]), as FSDP2 does.
preserve_version_counter = torch.autograd._unsafe_preserve_version_counter


def graph_task_id() -> int:
    """The running autograd graph task's id, -1 outside backward."""
    return torch._C._current_graph_task_id()


def queue_backward_callback(callback) -> None:
    """Run `callback` when the running backward's graph task ends (FSDP2 finalizes the same way)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


_STEP_ERROR_HOOKS: list = []


def _guarded(step):
    """`step` (a class's step, as torch's hooks wrap it) calling the step error hooks when it raises."""
    if getattr(step, "_sw_guarded", False):
        return step

    @functools.wraps(step)
    def guarded(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        except BaseException as error:
            for hook in _STEP_ERROR_HOOKS:
                hook(args[0], error)  # may raise the error to report instead
            raise

    guarded._sw_guarded = True
    if hasattr(step, "__wrapped__"):  # undecorated_step still finds the step under torch's hooks
        guarded.__wrapped__ = step.__wrapped__
    return guarded


_STEP_BODY_CONTEXTS: list = []
_TORCH_WRAPPER_CODE: list = []  # the code of torch's own step wrapper (functools.wraps copies its names)


def _in_body_contexts(func):
    """`func` (a class's own step, beneath torch's hook-running wrapper) run inside the contexts
    `on_step_body` asked for: the body alone, not the step hooks around it."""

    @functools.wraps(func)
    def body(*args, **kwargs):
        with contextlib.ExitStack() as contexts:
            for context in _STEP_BODY_CONTEXTS:
                contexts.enter_context(context(args[0]))
            return func(*args, **kwargs)

    return body


_BODY_CODE = _in_body_contexts(lambda: None).__code__  # what undecorated_step unwraps


def _patch_profile_hook_step() -> None:
    """torch wraps each optimizer class's `step` once, at its first instance (`profile_hook_step`, torch
    2.13): wrapping that function puts the error hooks around, and the body contexts beneath, the step of
    every class made from now on (`guard_step` reaches a class made before)."""
    from torch.optim.optimizer import Optimizer

    if not getattr(Optimizer.profile_hook_step, "_sw_guarding", False):
        original = Optimizer.profile_hook_step
        _TORCH_WRAPPER_CODE.append(original(lambda self: None).__code__)  # what guard_step recognizes

        def profile_hook_step(func):
            return _guarded(original(_in_body_contexts(func)))

        profile_hook_step._sw_guarding = True
        Optimizer.profile_hook_step = staticmethod(profile_hook_step)


def on_step_error(hook) -> None:
    """Call `hook(optimizer, error)` when an optimizer's step raises, before the error leaves `step()`
    (Note [raising step] in whole_step.py): torch offers pre and post step hooks, none for an error."""
    _STEP_ERROR_HOOKS.append(hook)
    _patch_profile_hook_step()


def on_step_body(context) -> None:
    """Run every optimizer's own step body (not its hooks) inside `context(optimizer)`, a context manager
    (Note [plain rows step] in optim_hooks.py)."""
    _STEP_BODY_CONTEXTS.append(context)
    _patch_profile_hook_step()


def guard_step(optimizer) -> None:
    """Bring the step of `optimizer`'s class, if torch wrapped it before `_patch_profile_hook_step`, up to
    date from its next step on: torch's own wrapper is made anew around the class's own step (error hooks
    around, body contexts beneath); a wrapper another library put around it gets the error hooks around it
    and runs without the body contexts."""
    from torch.optim.optimizer import Optimizer

    kind = type(optimizer)
    step = kind.step
    if _TORCH_WRAPPER_CODE and getattr(step, "__code__", None) is _TORCH_WRAPPER_CODE[0]:
        kind.step = Optimizer.profile_hook_step(step.__wrapped__)
        kind.step.hooked = True
    elif getattr(step, "hooked", False) and not getattr(step, "_sw_guarded", False):
        kind.step = _guarded(step)


def undecorated_step(optimizer):
    """The optimizer class's own `step`, without torch's wrapper that runs the step hooks and without the
    body contexts beneath it (offload.py steps one chunk at a time inside the user's step and must not
    re-enter the hooks)."""
    step = type(optimizer).step
    step = getattr(step, "__wrapped__", step)
    return step.__wrapped__ if getattr(step, "__code__", None) is _BODY_CODE else step


class Reach(enum.Enum):
    """What the autograd graph task now running does with a parameter's AccumulateGrad node."""

    RUNS = "runs"  # a backward that accumulates into the parameter (loss.backward())
    SKIPS = "skips"  # a task that does not need the parameter (autograd.grad(out, inputs))
    CAPTURES = "captures"  # autograd.grad with the parameter among its inputs


def reach(accumulate_node) -> Reach:
    """torch offers no public query. `_will_engine_execute_node` answers for the running task
    (True for every node in a plain backward), and raises, naming autograd.grad, for a leaf's
    AccumulateGrad node that autograd.grad captures as one of its inputs (torch 2.13)."""
    try:
        return Reach.RUNS if torch._C._will_engine_execute_node(accumulate_node) else Reach.SKIPS
    except RuntimeError as error:
        if _GRAD_CALL in str(error):
            return Reach.CAPTURES
        raise


# Note [rank-local clipping] (shard_param.py): torch's clipping functions by code object. They
# read `.grad` in a comprehension at their start, before touching any gradient.
_CLIPS = {inspect.unwrap(fn).__code__: fn.__name__ for fn in (
    torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grads_with_norm_, torch.nn.utils.clip_grad_value_)}


def refuse_clip_after_step() -> None:
    """Under sw.optimizer_in_backward only, from ShardParameter.grad: a `.grad` read from one of
    torch's clipping functions would find every gradient already stepped and dropped, and clip
    nothing without a word. Frame 2 is the reader (0: this function, 1: the property)."""
    frame = sys._getframe(2)
    if frame is not None and frame.f_code.co_name == "<listcomp>":  # Python 3.11 gives it a frame
        frame = frame.f_back
    function = _CLIPS.get(frame.f_code) if frame is not None else None
    if function is not None:
        raise ShardwiseError(
            f"torch.nn.utils.{function} with sw.optimizer_in_backward: every unit was stepped during "
            "backward and its gradient dropped, so there is nothing left to clip. Clip without "
            "optimizer_in_backward (Note [optimizer in backward])."
        )


def reparametrized(module: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """A context in which `module`'s parameters and buffers are `tensors` (by name, tied names
    following): what `torch.func.functional_call` does for one call, here held open across a
    backward too, so an activation checkpoint's recompute sees the same tensors (the estimator's
    probe, Note [activation probe])."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=True)


def compute_device() -> torch.device:
    """The device this process computes on when the model says none (deferred init's meta parameters): torch's
    current accelerator (CUDA, or any other torch names: XPU, MPS, a PrivateUse1 backend) at its current
    index, else the CPU. Asking `torch.cuda` alone put every other accelerator's shards on the CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())

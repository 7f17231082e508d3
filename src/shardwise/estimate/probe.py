"""The activation probe: the bytes one forward + backward of any model holds, besides its parameters.

Note [activation probe]: the probe runs one step of the model (its loss, then backward)
under a dispatch mode that sees every tensor an op creates. It counts each new storage
once (views share their base's) from the moment an op makes it until the last tensor on it
dies (a weak reference on the storage), and keeps the largest sum: the peak of the step's
own bytes, forward and backward, whatever the model's code does. Parameters, buffers and
views of them are not counted (the estimate has them); each parameter's gradient is dropped
as soon as autograd has accumulated it, as the zero engine reduces and frees a unit's
gradients (their bytes are the estimate's gradient and buffer rows).

It runs on the meta device: the parameters are swapped for meta tensors in the compute
dtype for the one call (`torch.func.functional_call`; the model is not changed and nothing
is allocated), so the probe costs Python time per op, not memory, and needs no real-size
model at any batch. Meta tensors are freed exactly when real ones would be: the counts equal
a real CPU run's byte for byte (tests/test_estimate.py checks this). A model whose forward
reads tensor values (data-dependent control flow) cannot run on meta; then the probe runs
for real, on CPU, at micro-batches of 1 and 2, and extrapolates linearly in the batch:
that path needs the model to fit one process (a meta-built model is materialized).

Note [probed recompute]: with `recompute=` (the units `checkpoint_activations=True` checkpoints,
engine/schedule/recompute.py), each of those modules runs under `torch.utils.checkpoint` (non-reentrant)
during the probe, as the engine runs it: forward keeps only each unit's inputs, and backward
recomputes one unit at a time, whose activations live only while its own backward runs. The
counter sees exactly those bytes, so the probe's peak is the checkpointed step's peak, not an
upper bound. The probe tensors stay in place across the backward (compat.reparametrized), so a
recompute reads them, not the model's own parameters.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from shardwise.engine.compat import reparametrized
from shardwise.errors import ShardwiseError
from shardwise.estimate.inputs import InputMaker, call, loss_of, make_inputs
from shardwise.interfaces import ActivationSized


@dataclass(frozen=True)
class ActivationProbe:
    """What one step holds besides parameters (bytes), and how it was found."""

    peak: int  # the most the step's own tensors held at once, forward and backward
    after_forward: int  # held when forward ended: what autograd saved, the output and the loss
    batch: int
    seq: int | None
    device: str  # "meta" (exact, at this batch) or "cpu" (micro-batches 1 and 2, extrapolated)


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages that ops create, while any tensor on them lives."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._known = {t.untyped_storage()._cdata for t in known}
        self._refs: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = storage._cdata
        if key in self._known or key in self._refs:
            return
        size = storage.nbytes()

        def freed(_, key=key, size=size):
            self.live -= size
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)


class _FusedAttention(TorchFunctionMode):
    """Note [fused attention]: under a dispatch mode `scaled_dot_product_attention` always takes
    its math path, which keeps each head's [seq, seq] weights; unobserved, on CPU, it runs the
    flash kernel, which keeps an output and a log-sum-exp per row. This calls the kernel torch
    would pick, so the probe sees what a real step keeps."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            fused = _flash_attention(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


_FLASH = 1  # torch.nn.attention.SDPBackend.FLASH_ATTENTION


def _flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """The CPU flash kernel's output when torch would choose it for these inputs, else None."""
    if query.device.type not in ("cpu", "meta") or query.dim() != 4:
        return None
    if key.shape[1] != query.shape[1] and not enable_gqa:
        return None
    # Grouped-query attention (fewer key/value heads: Qwen2, Mistral, Llama 3): the CPU flash kernel
    # takes it as it is, without repeating keys and values (what torch runs for enable_gqa=True); the
    # math path would keep each head's [seq, seq] weights (+12% on a 6-block Qwen2, bench/estimate/estimator_grid.py).

    def tiny(tensor):  # the same dims, dtype and head width on CPU: what the choice reads
        return torch.zeros((1,) * (tensor.dim() - 1) + tensor.shape[-1:], dtype=tensor.dtype)

    mask = None if attn_mask is None else torch.zeros((1,) * attn_mask.dim(), dtype=attn_mask.dtype)
    choice = torch._fused_sdp_choice(tiny(query), tiny(key), tiny(value), mask, dropout_p, is_causal, scale=scale,
                                     enable_gqa=enable_gqa)
    if choice != _FLASH:
        return None
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def probe_activations(model: nn.Module, batch: int, seq: int | None = None, *, dtype: torch.dtype | None = None,
                      inputs: InputMaker | None = None, recompute: tuple[nn.Module, ...] = ()) -> ActivationProbe:
    """Note [activation probe]: the peak bytes of one forward + backward of `model` on `batch`
    samples of `seq` tokens (inputs from `inputs`, else estimate/inputs.py), with floating
    parameters in `dtype` (default: the model's); the modules in `recompute` checkpointed (Note
    [probed recompute]). The model is not changed. The result is kept for the model while its
    parameters' names, shapes and dtypes stay the same (`plan` asks once per configuration)."""
    paths = {id(module): path for path, module in model.named_modules()}
    recompute = tuple(paths[id(module)] for module in recompute)  # by path: the CPU path probes a copy
    key = (batch, seq, dtype, inputs, model.training, recompute,
           tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()))
    found = _KEPT.setdefault(model, {})
    if key not in found:
        found[key] = _probe(model, batch, seq, dtype, inputs, recompute)
    return found[key]


_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: ActivationProbe}


def _probe(model, batch, seq, dtype, inputs, recompute) -> ActivationProbe:
    try:
        peak, after = _run_meta(model, batch, seq, dtype, inputs, recompute)
        return ActivationProbe(peak, after, batch, seq, "meta")
    except ShardwiseError:
        raise
    except (NotImplementedError, RuntimeError):  # the forward reads values: run for real (module docstring)
        pass
    (p1, a1), (p2, a2) = (_run_real(model, b, seq, dtype, inputs, recompute) for b in (1, 2))
    return ActivationProbe(p1 + (p2 - p1) * (batch - 1), a1 + (a2 - a1) * (batch - 1), batch, seq, "cpu")


def _run_meta(model, batch, seq, dtype, inputs, recompute=()) -> tuple[int, int]:
    params = {name: _leaf(p, "meta", dtype) for name, p in model.named_parameters()}
    buffers = {name: torch.empty_like(b, device="meta") for name, b in model.named_buffers()}
    return _measure(model, params, buffers, batch, seq, inputs, torch.device("meta"), recompute)


def _run_real(model, batch, seq, dtype, inputs, recompute=()) -> tuple[int, int]:
    real = model
    if any(p.device.type == "meta" for p in model.parameters()):
        real = copy.deepcopy(model).to_empty(device="cpu")  # the model must fit one process here
        with torch.no_grad():
            for p in real.parameters():
                p.normal_(0.0, 0.02)
    params = {name: _leaf(p, "cpu", dtype) for name, p in real.named_parameters()}
    return _measure(real, params, dict(real.named_buffers()), batch, seq, inputs, torch.device("cpu"), recompute)


def _measure(model, params, buffers, batch, seq, inputs, device, recompute) -> tuple[int, int]:
    known = list(params.values()) + list(buffers.values())
    handles = [p.register_post_accumulate_grad_hook(_drop_grad) for p in known if p.requires_grad]
    modules = dict(model.named_modules())
    originals = {path: modules[path].forward for path in recompute}
    own = {path: modules[path].__dict__.get("forward") for path in recompute}  # an instance's own forward
    try:
        for path in recompute:  # Note [probed recompute]
            modules[path].forward = _checkpointed(originals[path])
        with reparametrized(model, {**params, **buffers}), _FusedAttention(), _LiveBytes(known) as counter:
            made = make_inputs(model, batch, seq, device, inputs)
            output = call(model, made)
            loss = loss_of(output)
            del output  # as `model(**batch).loss.backward()` and HF's Trainer: logits die before backward
            after_forward = counter.live
            loss.backward()
            del made, loss
        return counter.peak, after_forward
    finally:
        for handle in handles:
            handle.remove()
        for path in recompute:
            if own[path] is not None:
                modules[path].forward = own[path]
            else:
                del modules[path].forward  # the class's own forward again


def _checkpointed(forward):
    """`forward` as `checkpoint_activations=True` runs a unit (engine/schedule/recompute.py). The recompute
    runs in backward, outside the probe's function mode: it enters _FusedAttention again, so it
    takes the attention kernel the forward took (Note [fused attention])."""
    def fused(*args, **kwargs):
        with _FusedAttention():
            return forward(*args, **kwargs)

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(fused, *args, use_reentrant=False, **kwargs)
    return run


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def _leaf(param: torch.Tensor, device: str, dtype: torch.dtype | None) -> torch.Tensor:
    """A fresh leaf standing in for `param` (its requires_grad), floating point in `dtype` when given."""
    to = dtype if dtype is not None and param.is_floating_point() else param.dtype
    if device == "meta":
        leaf = torch.empty(param.shape, dtype=to, device="meta")
    else:
        leaf = param.detach().to(to, copy=True)
    return leaf.requires_grad_(param.requires_grad)


def formula_activations(sizer, batch: int, seq: int | None, c: int, checkpointed: bool) -> int:
    """Note [activations] (estimate/core.py): a model's own formula (`ActivationSized`), for a bare count."""
    if not isinstance(sizer, ActivationSized):
        raise ShardwiseError(
            "activations of a bare parameter count need sizes: pass the model itself (its activations are "
            "measured by a probe), or config= with an `activation_bytes(batch, seq, dtype_bytes, checkpointed)` "
            "method (shardwise.interfaces.ActivationSized), or leave batch=None")
    return int(sizer.activation_bytes(batch, seq, c, checkpointed))

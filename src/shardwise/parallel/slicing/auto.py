"""`plan="auto"`: a slicing plan found from the model.

A model that knows its own plan says it (`model.slice_plan()`, as `shardwise.models.gpt.GPT`
does: model knowledge stays with the model). Hugging Face decoder models are read from their
structure, the way their own `_tp_plan` is written: attention modules with q/k/v/o projections
(Llama, Mistral, Qwen2: q/k/v column-sliced by heads, o row-sliced) or GPT-2's fused `c_attn`
(`Conv1D`, column-sliced in three parts by heads; the module's head count and split size
divided), MLPs with gate/up/down (Llama) or `c_fc`/`c_proj` (GPT-2) projections, and the input
embedding and output head (`get_input_embeddings()`, `get_output_embeddings()`) by vocabulary.
Anything else is refused with the fix: pass an explicit plan.
"""

from __future__ import annotations

from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.parallel.slicing.plan import Slice


def auto_plan(model: nn.Module) -> dict[str, Slice | str]:
    """The plan `sw.slice(model)` uses when no plan is given (module docstring)."""
    own = getattr(model, "slice_plan", None)
    if callable(own):
        return dict(own())
    names = {id(m): n for n, m in model.named_modules()}
    plan: dict[str, Slice | str] = {}
    # The outermost Hugging Face model (the root, or the one a user's wrapper holds) has the config
    # and the embedding getters.
    hf = next((m for m in model.modules() if callable(getattr(m, "get_input_embeddings", None))
               and getattr(m, "config", None) is not None), None)
    for name, module in model.named_modules():
        children = dict(module.named_children())
        config = getattr(module, "config", None) or getattr(hf, "config", None)
        if {"q_proj", "k_proj", "v_proj", "o_proj"} <= children.keys() and config is not None:
            heads = _config_int(config, "num_attention_heads", name)
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            plan[f"{name}.q_proj"] = Slice("colwise", heads=heads)
            plan[f"{name}.k_proj"] = Slice("colwise", heads=kv_heads)
            plan[f"{name}.v_proj"] = Slice("colwise", heads=kv_heads)
            plan[f"{name}.o_proj"] = Slice("rowwise", heads=heads)
        elif {"c_attn", "c_proj"} <= children.keys() and hasattr(module, "split_size"):
            if getattr(module, "is_cross_attention", False):
                raise ShardwiseError(f"{name}: cross-attention is not sliced automatically; pass an explicit plan")
            plan[name] = Slice("divide", attrs=("num_heads", "split_size"))
            plan[f"{name}.c_attn"] = Slice("colwise", parts=3, heads=module.num_heads)
            plan[f"{name}.c_proj"] = Slice("rowwise", heads=module.num_heads)
        elif {"gate_proj", "up_proj", "down_proj"} <= children.keys():
            plan.update({f"{name}.gate_proj": "colwise", f"{name}.up_proj": "colwise", f"{name}.down_proj": "rowwise"})
        elif {"c_fc", "c_proj"} <= children.keys():
            plan.update({f"{name}.c_fc": "colwise", f"{name}.c_proj": "rowwise"})
    for getter in ("get_input_embeddings", "get_output_embeddings") if hf is not None else ():
        module = getattr(hf, getter, lambda: None)()
        if module is not None and id(module) in names:
            plan[names[id(module)]] = "vocab"
    if not plan:
        raise ShardwiseError(
            f"no slicing plan found for {type(model).__name__}: it has no slice_plan() and none of the Hugging Face "
            "structures shardwise knows (q/k/v/o_proj, c_attn/c_proj, gate/up/down_proj). Pass an explicit plan: "
            "sw.slice(model, {'layers.*.fc1': 'colwise', 'layers.*.fc2': 'rowwise'})")
    return plan


def _config_int(config, field: str, where: str) -> int:
    value = getattr(config, field, None)
    if not isinstance(value, int):
        raise ShardwiseError(f"{where}: the model's config has no integer {field}; pass an explicit plan")
    return value

"""Issue 47's arms of bench/speed/strategies.py: shardwise zero3 with hpZ, and with hpZ and compression, on 2
simulated nodes of N/2 ranks (N = 4: 2 x 2), beside flat zero3 and HSDP zero3 (strategies.py's own arms).

Note [comm arms]: on one host every link is loopback, so "nodes" are simulated: ranks 0..N/2-1 are node 0,
the rest node 1 (torchrun's numbering, the layout's node groups). hpZ (`reshard_after_forward=N/2`, Note
[secondary shards]) keeps each unit's 1/(N/2) chunk in the node after forward, so backward's re-gather runs
over N/2 ranks instead of N; compression (`sw.Compression`, Note [quantized collectives]) sends forward's
gathers int8 and the gradient reduce int8 or int4. The bytes these save cross a slow link on real nodes;
here they cross the same loopback, so a step time shows the CPU cost of each option (the quantize and
dequantize kernels, the smaller in-node gathers), not its saving at scale: bench/comm/traffic.py models that.
The compressed arms are not exact by design: their loss differs from the reference's, by the loss-curve
gaps of bench/correctness/results/loss_curves.md.
"""

from __future__ import annotations

CONFIGS = ("zero3_hpz", "zero3_hpz_q8", "zero3_hpz_q4")
LABELS = {"zero3_hpz": "shardwise zero3 + hpZ (2 nodes)",
          "zero3_hpz_q8": "shardwise zero3 + hpZ + int8 gather/int8 reduce",
          "zero3_hpz_q4": "shardwise zero3 + hpZ + int8 gather/int4 reduce"}
FORMULA = {c: (0, 16) for c in CONFIGS}  # as zero3: hpZ's chunks live from forward to backward, not in the state
_REDUCE = {"zero3_hpz_q8": "int8", "zero3_hpz_q4": "int4"}
MIN_WORLD_SIZE = 4  # 2 nodes of at least 2: hpZ needs nodes of more than one rank


def unfit_world_sizes(configs: list[str], world_sizes: list[int]) -> list[int]:
    """The world sizes these arms cannot run at (odd, or fewer than 2 nodes of 2) when any of them is asked."""
    if not set(configs) & set(CONFIGS):
        return []
    return [ws for ws in world_sizes if ws < MIN_WORLD_SIZE or ws % 2]


def apply(model, config: str, world_size: int, adamw: dict):
    """Shard `model` as `config` says (Note [comm arms]); return (module to call, optimizer)."""
    import torch

    import shardwise as sw
    from shardwise.models.gpt import Block

    compression = sw.Compression(gather="int8", reduce=_REDUCE[config]) if config in _REDUCE else None
    sw.shard(model, strategy="zero3", units=Block, reshard_after_forward=world_size // 2, compression=compression)
    return model, torch.optim.AdamW(model.parameters(), **adamw)

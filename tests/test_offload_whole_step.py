"""Disk offload with an optimizer stepped on whole tensors (Note [what a chunk can step], engine/memory/offload.py):
exact where rows are the whole tensor (one rank), refused over ranks."""

import torch
import torch.distributed as dist

import shardwise as sw


def _muon_under_disk_offload(path: str) -> dict:
    """3 Muon steps on a zero3 model with offload='disk:PATH' beside the same without offload: the ShardwiseError's
    message on this rank, or the names whose values differ."""

    def trained(offload):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        sw.shard(model, strategy="zero3", offload=offload)
        optimizer = torch.optim.Muon([p for p in model.parameters() if p.dim() == 2], lr=0.02)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return sw.full_parameters(model)

    try:
        offloaded = trained(f"disk:{path}")
    except sw.ShardwiseError as error:
        return {"refused": str(error)}
    plain = trained(None)
    return {"refused": None, "differ": [n for n in plain if not torch.equal(plain[n], offloaded[n])]}


def test_whole_tensor_optimizer_under_disk_offload_is_exact_or_refused(ranks, tmp_path):
    """Catches disk offload's chunked step running an optimizer that reads whole tensors (Muon's Newton-Schulz
    on the matrix) on each rank's rows: over ranks it trained another model without a word. At one rank (rows
    are the whole tensor) bitwise the run without offload; at two refused on every rank, naming the fix."""
    assert ranks.run(_muon_under_disk_offload, 1, str(tmp_path)) == [{"refused": None, "differ": []}]
    for message in [result["refused"] for result in ranks.run(_muon_under_disk_offload, 2, str(tmp_path))]:
        assert message is not None and "Muon steps whole tensors" in message and "Drop offload=" in message, message

"""LoadReport, strict and fine-tuning loads, name cleaning and renames
(in this process: no ranks needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("scale", torch.tensor(2.0))


class Classifier(nn.Module):
    """A pretrained body and a head of `classes` outputs; `head_name` renames the head."""

    def __init__(self, classes: int, head_name: str = "head"):
        super().__init__()
        self.body = Body()
        setattr(self, head_name, nn.Linear(16, classes))


class Compiled(nn.Module):
    """Names like torch.compile's wrapper (`_orig_mod.*`), without compiling anything."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self._orig_mod = model


def test_fine_tune_a_changed_head(tmp_path):
    """Catches strict loading silently skipping a changed head, and strict=False refusing
    (or half-loading) a body whose head changed shape: the body and its buffer load, the
    head keeps its new values, and the report says so."""
    torch.manual_seed(0)
    pretrained = Classifier(classes=10)
    sw.save(tmp_path / "pretrained", pretrained)
    model = Classifier(classes=3)
    head_before = model.head.weight.clone()
    with pytest.raises(sw.ShardwiseError) as caught:
        sw.load(tmp_path / "pretrained", model)
    assert "head.weight: checkpoint [10, 16], model [3, 16]" in str(caught.value)
    assert torch.equal(model.head.weight, head_before), "a refused strict load must change nothing"
    report = sw.load(tmp_path / "pretrained", model, strict=False)
    assert [m[0] for m in report.mismatched] == ["head.weight", "head.bias"] and not report.ok
    assert set(report.loaded) == {"body.embed.weight", "body.embed.bias", "body.norm.weight", "body.norm.bias",
                                  "body.scale"}
    assert torch.equal(model.body.embed.weight, pretrained.body.embed.weight)
    assert torch.equal(model.head.weight, head_before)
    assert "shape mismatch, not loaded (2)" in str(report)


def test_missing_and_unexpected_names_with_closest(tmp_path):
    """Catches a report that lists names without telling the user what they probably meant,
    and a rename that does not apply (dict and regex forms)."""
    sw.save(tmp_path / "ckpt", Classifier(classes=3, head_name="head"))
    model = Classifier(classes=3, head_name="classifier")
    with pytest.raises(sw.ShardwiseError) as caught:
        sw.load(tmp_path / "ckpt", model)
    message = str(caught.value)
    assert "missing from the checkpoint" in message and "unexpected in the checkpoint" in message
    assert "classifier.weight   (closest: head.weight)" in message
    assert "head.weight   (closest: classifier.weight)" in message
    assert sw.load(tmp_path / "ckpt", model, rename=[(r"^head\.", "classifier.")]).ok
    sw.save(tmp_path / "body", Body())  # saved alone: every name lacks the model's "body." prefix
    with pytest.raises(sw.ShardwiseError, match=r"rename=\[\(r'\^', 'body\.'\)\] maps them"):
        sw.load(tmp_path / "body", model)
    assert sw.load(tmp_path / "ckpt", model, rename={"head.weight": "classifier.weight",
                                                     "head.bias": "classifier.bias"}).ok


def test_wrapper_prefixes_are_stripped_on_both_sides(tmp_path):
    """Catches `module.` / `_orig_mod.` / `_fsdp_wrapped_module.` prefixes making every key
    "missing": in a torch.save'd state dict, and in the model being loaded into."""
    torch.manual_seed(1)
    source = Classifier(classes=3)
    wrapped = {f"module._orig_mod.{k}".replace("body.", "body._fsdp_wrapped_module."): v
               for k, v in source.state_dict().items()}
    torch.save(wrapped, tmp_path / "wrapped.pt")
    target = Classifier(classes=3)
    assert sw.load(tmp_path / "wrapped.pt", target).ok
    assert torch.equal(target.body.embed.weight, source.body.embed.weight)
    compiled = Compiled(Classifier(classes=3))
    assert sw.load(tmp_path / "wrapped.pt", compiled).ok
    sw.save(tmp_path / "from-compiled", compiled)
    assert sw.load(tmp_path / "from-compiled", Classifier(classes=3)).ok


def test_optimizer_and_scheduler_problems_are_reported(tmp_path):
    """Catches a resume that silently starts a fresh optimizer because the checkpoint had none."""
    model = Classifier(classes=3)
    sw.save(tmp_path / "weights-only", model)
    optim = torch.optim.AdamW(model.parameters())
    with pytest.raises(sw.ShardwiseError, match="holds no optimizer state"):
        sw.load(tmp_path / "weights-only", model, optim)
    report = sw.load(tmp_path / "weights-only", model, optim, strict=False)
    assert report.problems and not report.ok


class Custom:
    """A class a pickle would construct (and could run code for) on load."""


def test_torch_file_with_objects_is_refused(tmp_path):
    """Catches `sw.load` unpickling arbitrary objects from a torch file (it must use weights_only)."""

    torch.save({"weights": Custom()}, tmp_path / "evil.pt")
    with pytest.raises(sw.ShardwiseError, match="weights_only=True"):
        sw.load(tmp_path / "evil.pt", Classifier(classes=3))

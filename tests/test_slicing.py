"""`sw.slice`: layers sliced across a tensor group (and zero3 over a data group on a 2-D mesh)
match one process at DESIGN's fp32 bound after 5 AdamW steps, and every misuse raises a
ShardwiseError on every rank.

A (data x tensor) run slices over the mesh's "tensor" dimension and shards with zero3 over its
"data" dimension; each data rank trains on its slice of the global batch, which every rank of
its tensor group shares. Losses and the full (unsliced, unsharded) parameters are compared."""

from __future__ import annotations

import pytest
import torch

from helpers.slicing import (
    auto_plan_of,
    checkpoint_phase,
    count_step,
    export_phase,
    fp16_overflow_on_one_tensor_rank,
    full_logits,
    misuse,
    reference,
    reference_resume,
    run_mesh,
    train_precision,
)
from shardwise.testing import assert_close_runs

# (model, data, tensor, strategy): each slicing size on its own, zero3 alone through the slicing
# path (4 x 1), and the 2-D mesh (with every strategy over its data axis). "llama" has 2 key/value
# heads (grouped-query attention), "llama_kv4" 4, so that 4 slices hold one of each; "uneven": sizes
# no group divides.
GRID = [
    ("gpt", 1, 2, None),
    ("gpt", 1, 4, None),
    ("gpt", 2, 2, "zero3"),
    ("gpt", 4, 1, "zero3"),
    ("gpt", 1, 4, "zero3"),
    ("gpt", 2, 2, "zero1"),
    ("gpt", 2, 2, "zero2"),
    ("gpt", 2, 2, "ddp"),
    ("llama", 1, 2, None),
    ("llama", 2, 2, "zero3"),
    ("llama_kv4", 1, 4, None),
    ("gpt2", 1, 2, None),
    ("llama_labels", 1, 2, None),  # Hugging Face's own loss: model(input_ids, labels=...).loss
    ("gpt2_labels", 1, 2, None),
    ("uneven", 1, 3, None),
    ("uneven", 1, 4, None),
]


@pytest.mark.parametrize("name,data,tensor,strategy", GRID, ids=lambda v: str(v))
def test_sliced_matches_one_process(ranks, name, data, tensor, strategy):
    """Catches a missing or doubled reduction on either axis (f's gradient all-reduce, g's forward
    all-reduce, the engine's data-axis average), a bias added once per slice, q/k/v cut across heads
    or parts, vocabulary slices that double-count or drop a row, a loss computed on one slice, an
    uneven split that loses a feature, a tied embedding/head that became two parameters, data
    that differs across the tensor axis, and transformers' own `labels=` loss refused or computed
    on one slice: any of these moves losses or parameters past 1e-5."""
    got = ranks.run(run_mesh, data * tensor, name, data, tensor, strategy, timeout=300)
    ref = reference(name)
    for rank, result in enumerate(got):
        try:
            assert_close_runs(ref, result)
        except AssertionError as error:
            raise AssertionError(f"{name} on {data} x {tensor} ({strategy}): rank {rank} differs\n{error}") from None


@pytest.mark.parametrize("data,tensor,strategy,norm_type,clip", [
    (1, 2, None, 2.0, 0.5), (2, 2, "zero3", 2.0, 0.5), (1, 2, None, float("inf"), 0.02),
    (2, 2, "zero3", float("inf"), 0.02)])
def test_clipping_a_sliced_model_uses_the_whole_norm(ranks, data, tensor, strategy, norm_type, clip):
    """Catches sw.clip_grad_norm_ taking the norm of one rank's slices (or counting an unsliced
    parameter once per tensor rank, or an ∞-norm that is not the largest over ranks): the grad
    norms and the clipped steps would differ."""
    ref = reference("gpt", clip=clip, norm_type=norm_type)
    assert max(ref.grad_norms) > clip, ref.grad_norms  # clipping acts, so a wrong norm shows
    for rank, result in enumerate(ranks.run(run_mesh, data * tensor, "gpt", data, tensor, strategy, 5, 8, clip,
                                            norm_type, timeout=300)):
        try:
            assert_close_runs(ref, result)
        except AssertionError as error:
            raise AssertionError(f"{data} x {tensor}: rank {rank} differs\n{error}") from None


def test_gathered_logits_and_their_gradients_match_one_process(ranks):
    """Catches sw.gather_logits putting vocabulary slices in the wrong columns, and a backward
    through it that sends a slice's gradient to the wrong rank."""
    ref_logits, ref_grads, _ = full_logits("gpt", 0)
    for logits, grads, _ in ranks.run(full_logits, 2, "gpt", 2):
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
        for name, grad in ref_grads.items():
            # Raw gradients of a sum of squared logits (values up to ~0.1): the slices' partial sums
            # are added in another order, which moves a few elements by ~3e-6 (measured); a misplaced
            # slice moves them by their whole size.
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5)


# case -> (world size, words the message must hold)
MISUSE = {
    "heads_not_divisible": (2, ["n_heads=3 cannot be divided by 2 tensor ranks"]),
    "kv_heads_not_divisible": (4, ["k_proj", "2 heads cannot be sliced 4 ways"]),
    "slice_after_shard": (2, ["already sharded", "before sw.shard"]),
    "slice_twice": (2, ["already sliced"]),
    "missing_module": (2, ["'blocks.*.fc9' names no module"]),
    "bad_style": (2, ["'columnwise' is not a slice"]),
    "two_entries": (2, ["named by two plan entries"]),
    "unnamed_2d_mesh": (2, ["name one dimension 'tensor'"]),
    "shard_over_tensor_ranks": (2, ["mesh['data'].get_group()"]),
    "tied_sliced_two_ways": (2, ["tied to a parameter already sliced another way"]),
    "logits_argmax": (2, ["argmax on vocabulary-sliced logits", "sw.gather_logits"]),
    "logits_softmax": (2, ["softmax on vocabulary-sliced logits"]),
    "pipeline_of_sliced": (2, ["this model is sliced", "pipeline"]),
    "state_dict_of_sliced": (2, ["sw.full_state_dict(model)"]),
    "deferred": (2, ["meta device", "build the model eagerly"]),
    "save_without_data_strategy": (4, ["spans the whole world (4 ranks)", "1 data x 2 tensor"]),
    "different_inputs": (2, ["different inputs", "mesh['data'].get_local_rank()"]),
    "mesh3d_unsliced": (4, ["is not sliced", "sw.slice(model, group=mesh)"]),
    "mesh3d_other_tensor_group": (4, ["sliced over another group", "sw.shard(model, ..., mesh=mesh)"]),
}


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_misuse_raises_on_every_rank(ranks, case):
    """Catches each misuse going through silently (heads split mid-head, a plan typo that slices
    nothing, zero3 overwriting other slices with rank 0's, a loss or argmax over one rank's part of
    the vocabulary) or raising on only some ranks (the others would hang in the next collective)."""
    world, words = MISUSE[case]
    messages = ranks.run(misuse, world, case, timeout=120)
    for rank, message in enumerate(messages):
        assert message is not None, f"{case}: rank {rank} raised nothing"
        for word in words:
            assert word in message, f"{case}: rank {rank}'s message lacks {word!r}: {message}"


def test_auto_plans_slice_every_layer_they_should(ranks):
    """Catches an automatic plan that quietly slices less than the model's attention, MLP,
    embedding and head (still exact, but the memory it promises is not saved): Llama inside a
    user's wrapper module, GPT-2's Conv1D blocks, the zoo GPT's own plan."""
    llama, gpt2, gpt = (ranks.run(auto_plan_of, 2, name)[0] for name in ("llama", "gpt2", "gpt"))
    for layer in range(2):
        prefix = f"lm.model.layers.{layer}"
        for proj, kind in (("q_proj", "colwise"), ("k_proj", "colwise"), ("v_proj", "colwise"),
                           ("o_proj", "rowwise")):
            assert llama[f"{prefix}.self_attn.{proj}"] == kind
        for proj, kind in (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise")):
            assert llama[f"{prefix}.mlp.{proj}"] == kind
        assert gpt2[f"lm.transformer.h.{layer}.attn"] == "divide"
        assert gpt2[f"lm.transformer.h.{layer}.attn.c_attn"] == "colwise"
        assert gpt2[f"lm.transformer.h.{layer}.mlp.c_proj"] == "rowwise"
        assert gpt[f"blocks.{layer}.qkv"] == "colwise" and gpt[f"blocks.{layer}.mlp.2"] == "rowwise"
    assert llama["lm.model.embed_tokens"] == llama["lm.lm_head"] == "vocab"
    assert gpt2["lm.transformer.wte"] == gpt2["lm.lm_head"] == "vocab"
    assert gpt["tok_emb"] == gpt["head"] == "vocab"


# (saved as, loaded as): (data, tensor, sliced). 2 x 2 to 4 x 1 (zero3, unsliced), to 1 x 1 (a
# plain model) and to 2 x 2 again; 4 x 1 and 1 x 1 back to sliced layouts.
CHECKPOINT_GRID = [
    ("gpt", (2, 2, True), (4, 1, False)),
    ("gpt", (2, 2, True), (1, 1, False)),
    ("gpt", (2, 2, True), (2, 2, True)),
    ("gpt", (4, 1, False), (2, 2, True)),
    ("gpt", (1, 1, False), (1, 4, True)),
    ("gpt", (1, 4, True), (2, 2, True)),
    ("gpt", (2, 2, True, "ddp"), (2, 2, True)),  # ddp over the data axis: whole slices, replicated
    ("llama", (2, 2, True), (1, 1, False)),  # grouped-query k/v slices, an untied vocabulary head
]


@pytest.mark.parametrize("name,saved,loaded", CHECKPOINT_GRID,
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v[:2])) + "s" * v[2] + (
                             v[3] if len(v) > 3 else ""))
def test_checkpoint_across_mesh_shapes_resumes_exactly(ranks, tmp_path, name, saved, loaded):
    """Catches a checkpoint that stores slices as if they were rows (wrong columns of a row-sliced
    weight, q/k/v runs out of place), a load that puts whole rows where a slice belongs, optimizer
    state that is not carried across layouts, and tied weights stored twice and loaded apart: the
    resumed run would leave the single process's continuation."""
    path = str(tmp_path / "ckpt")
    saved, loaded = (layout if len(layout) == 4 else (*layout, "zero3") for layout in (saved, loaded))
    ranks.run(checkpoint_phase, saved[0] * saved[1], name, *saved, path, False, timeout=300)
    got = ranks.run(checkpoint_phase, loaded[0] * loaded[1], name, *loaded, path, True, timeout=300)
    ref = reference_resume(name)
    for rank, result in enumerate(got):
        try:
            assert_close_runs(ref, result)
        except AssertionError as error:
            raise AssertionError(f"{name} saved {saved}, loaded {loaded}: rank {rank} differs\n{error}") from None


def test_full_state_dict_and_export_hold_unsliced_tensors(ranks, tmp_path):
    """Catches sw.full_state_dict / sw.export writing a rank's slices (shapes of one slice, or
    the slices of one rank only) instead of the whole tensors, and the tied head missing."""
    from safetensors.torch import load_file

    path = tmp_path / "model.safetensors"
    out = ranks.run(export_phase, 4, "gpt", 2, 2, str(path), timeout=300)
    state, params = out[0]["state"], out[0]["params"]
    exported = load_file(str(path))
    assert set(params) <= set(state) and "head.weight" in state
    for name, value in params.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0)
    torch.testing.assert_close(state["head.weight"], params["tok_emb.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("data,tensor", [(4, 1), (2, 2), (1, 4), (1, 2)])
def test_bytes_moved_per_step_match_the_model(ranks, data, tensor):
    """Catches a layout that moves more than Note [traffic model] says: a pair of sliced layers
    with more than one all-reduce each way, logits gathered for the loss, a collective issued on a
    one-rank tensor group, an extra zero3 re-gather or a reduce-scatter of more than the slices."""
    for rank, out in enumerate(ranks.run(count_step, data * tensor, "gpt", data, tensor, timeout=300)):
        payload = ("data_gather", "data_reduce", "tensor_reduce")  # wire bytes depend on the engine's
        # choice of collective (Note [gloo collectives] in the engine may reduce by all-reduce)
        assert {k: out["counted"][k] for k in payload} == {k: out["predicted"][k] for k in payload}, (
            data, tensor, rank, out)
        # f and g: one all-reduce each way per pair (2 pairs per block), embedding, head, loss, and the
        # same-inputs check; none on a one-rank tensor group
        assert out["calls"].get("tensor_all_reduce", 0) == (4 * 2 + 2 + 2 + 1 if tensor > 1 else 0), out["calls"]
        if data > 1:  # sharded: the engine's layout holds the slicing's tensor dimension and says so
            assert out["layout"]["dims"] == {"pipe": 1, "replicate": 1, "shard": data, "tensor": tensor}, out
            assert out["layout"]["same_tensor_group"], out
            expected = f"layout: shard {data}" + (f" x tensor {tensor}" if tensor > 1 else "")
            assert out["layout"]["described"] == [expected], out


def test_bf16_on_a_sliced_sharded_model_tracks_fp32(ranks):
    """Catches a low-precision path through the slices that trains differently (the sliced loss or
    the f/g all-reduces in the wrong dtype, masters stored in bf16), or does not run in bf16 at all.
    Tolerance as tests/test_precision.py's (bf16's spacing near a loss of 4 is 0.031): over 50 steps
    the mean difference under two spacings, the last 10 steps' mean within 0.5%."""
    fp32, _ = ranks.run(train_precision, 4, "fp32", 50, timeout=600)[0]
    low, dtypes = ranks.run(train_precision, 4, "bf16", 50, timeout=600)[0]
    assert dtypes == {"torch.float32"}  # the optimizer steps fp32 masters
    diffs = [abs(a - b) for a, b in zip(low, fp32)]
    assert sum(diffs) / len(diffs) < 0.06, diffs
    assert abs(sum(low[-10:]) - sum(fp32[-10:])) / abs(sum(fp32[-10:])) < 0.005
    assert low != fp32  # it really ran in bf16


def test_fp16_overflow_on_one_tensor_rank_skips_the_step_everywhere(ranks):
    """Catches a loss scaler that agrees on an overflow only within the data group: the tensor rank
    that saw the inf would skip the step while its peers took it, and the slices would part."""
    for rank, record in enumerate(ranks.run(fp16_overflow_on_one_tensor_rank, 4, timeout=300)):
        assert [took for took, _ in record] == [True, False, True], (rank, record)
        assert [unchanged for _, unchanged in record] == [False, True, False], (rank, record)

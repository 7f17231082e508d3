"""Accelerate's training loop on a sharded model through ShardwiseAccelerator (Note [accelerate
integration]): losses, grad norms and parameters equal the same loop on one process."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from helpers.parity import assert_trainer_run_matches, log_distance
from helpers.tiny import tiny_gpt2

pytest.importorskip("accelerate")
STEPS = 3


def _train(strategy, accumulate, save_dir=None, mixed_precision="no"):
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState

    from shardwise.integrations.accelerate import ShardwiseAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)  # the pool's processes run many tests
    model = tiny_gpt2()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)  # built before shard(): the HF order
    ids = torch.randint(0, 128, (8 * STEPS * accumulate, 8), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(ids, batch_size=8)  # the global batch; split over the ranks
    options = dict(cpu=True, gradient_accumulation_steps=accumulate, mixed_precision=mixed_precision,
                   dataloader_config=DataLoaderConfiguration(split_batches=True))
    seen = []  # what block 0's MLP computed in: (autocast on, output dtype)
    model.transformer.h[0].mlp.register_forward_hook(
        lambda module, inputs, output: seen.append((torch.is_autocast_enabled("cpu"), str(output.dtype))))
    if strategy == "none":
        accelerator = Accelerator(**options)
    else:
        sw.shard(model, strategy=strategy)
        accelerator = ShardwiseAccelerator(**options)
    model, optim, loader = accelerator.prepare(model, optim, loader)
    logs = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                logs.append((accelerator.reduce(loss.detach(), "mean").item(), float(norm)))
            optim.step()
            optim.zero_grad()
    if save_dir is not None:
        accelerator.save_model(model, save_dir)
    params = sw.full_parameters(model) if strategy != "none" else \
        {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    if mixed_precision != "no":
        return logs, seen[0]
    return logs, params


@pytest.mark.parametrize("strategy, accumulate", [("zero2", 1), ("zero3", 2)])
def test_accelerate_loop_matches_one_process(ranks, tmp_path, strategy, accumulate):
    """Catches Accelerate's DDP wrap, its rank-local clipping, accumulation reducing every
    micro-batch, and save_model writing this rank's rows: 3 clipped AdamW steps at world size 2
    log the losses and grad norms of one process and end equal; the saved model loads whole."""
    (reference_logs, reference), = ranks.run(_train, 1, "none", accumulate, timeout=180)
    results = ranks.run(_train, 2, strategy, accumulate, str(tmp_path / "saved"), timeout=180)
    for logs, params in results:
        assert_trainer_run_matches(logs, params, reference_logs, reference, STEPS)
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    for name, value in results[0][1].items():
        if name in saved:
            assert torch.equal(saved[name], value), name
    assert saved["transformer.wte.weight"].shape == (128, 32)


@pytest.mark.slow  # 3 runs of 2 ranks (~14 s on 2 busy cores)
def test_accelerate_bf16_autocasts_as_the_plain_accelerator(ranks):
    """Catches mixed_precision="bf16" refused, or accepted and ignored (the forward in fp32): the plain
    Accelerator under torch DDP and ShardwiseAccelerator (zero3) on the same 2 ranks both compute block 0
    in bf16 under autocast, and log losses and grad norms within twice the plain Accelerator's own
    distance from one process (bf16 rounds the ranks' partial sums differently), as
    tests/test_trainer_args.py holds the Trainer's bf16."""
    (plain, plain_seen), _ = ranks.run(_train, 2, "none", 1, None, "bf16", timeout=180)
    (mine, seen), _ = ranks.run(_train, 2, "zero3", 1, None, "bf16", timeout=180)
    (one, _), = ranks.run(_train, 1, "none", 1, None, "bf16", timeout=180)
    assert seen == plain_seen == (True, "torch.bfloat16"), (seen, plain_seen)
    assert len(mine) == len(plain) == STEPS
    assert log_distance(mine, plain) <= 2 * log_distance(plain, one) + 1e-6, (mine, plain, one)


def _prepare_fp16():
    from accelerate.state import AcceleratorState

    from shardwise.integrations.accelerate import ShardwiseAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    sw.shard(model, strategy="zero2", units=torch.nn.Linear)
    try:
        ShardwiseAccelerator(cpu=True, mixed_precision="fp16").prepare(model)
    except sw.ShardwiseError as error:
        return str(error)
    return None


def test_accelerate_fp16_is_refused_with_the_shardwise_way(ranks):
    """Catches fp16 through Accelerate's GradScaler, whose inf/NaN check sees this rank's rows only:
    refused on every rank with shardwise's precision="fp16", as ShardwiseTrainer refuses fp16=True."""
    for message in ranks.run(_prepare_fp16, 2, timeout=120):
        assert message is not None and 'precision="fp16"' in message, message


def _resume(path, phase):
    """Muon + AdamW (two optimizers) and a scheduler under ShardwiseAccelerator, zero2: phase "save" trains
    3 steps, save_state, 3 more; "load" builds everything afresh (another seed), load_state, the same 3."""
    import transformers
    from accelerate.state import AcceleratorState

    from shardwise.integrations.accelerate import ShardwiseAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0 if phase == "save" else 1)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=128, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    sw.shard(model, strategy="zero2")
    muon = torch.optim.Muon([p for p in model.parameters() if p.dim() == 2], lr=0.02)
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.dim() != 2], lr=1e-2, eps=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.9 ** step)
    accelerator = ShardwiseAccelerator(cpu=True)
    model, muon, adamw, schedule = accelerator.prepare(model, muon, adamw, schedule)
    rank = torch.distributed.get_rank()
    ids = torch.randint(0, 128, (8 * 6, 8), generator=torch.Generator().manual_seed(1))

    def steps(start, end):
        losses = []
        for step in range(start, end):
            batch = ids[step * 8 : (step + 1) * 8][rank * 4 : (rank + 1) * 4]
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            muon.step()
            adamw.step()
            schedule.step()
            muon.zero_grad()
            adamw.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
        return losses

    if phase == "save":
        steps(0, 3)
        accelerator.save_state(path)
    else:
        accelerator.load_state(path)
    return steps(3, 6), sw.full_parameters(model)


@pytest.mark.slow  # about 20 s on a quiet machine (transformers' GPT-2, two launches)
def test_accelerate_save_state_resumes_muon_and_adamw_bitwise(ranks, tmp_path):
    """Catches save_state writing rank 0's optimizer rows (or, for Muon, the momenta of the matrices rank 0
    owns) as the whole state, a second optimizer or the scheduler left out, or load_state not restoring
    them: the resumed steps 3-5 must be bitwise the uninterrupted run's (Note [accelerate state])."""
    path = str(tmp_path / "state")
    expected = ranks.run(_resume, 2, path, "save", timeout=180)
    from shardwise.checkpoint.format.schema import read_index
    assert [o.class_name for o in read_index(tmp_path / "state").optimizers] == ["torch.optim.Muon",
                                                                                   "torch.optim.adamw.AdamW"]
    for (losses, params), (want_losses, want) in zip(ranks.run(_resume, 2, path, "load", timeout=180), expected):
        assert losses == want_losses
        assert all(torch.equal(params[name], value) for name, value in want.items())


def _prepare_without_cpu_flag():
    from accelerate.state import AcceleratorState

    from shardwise.integrations.accelerate import ShardwiseAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    sw.shard(model, strategy="zero2", units=torch.nn.Linear)
    accelerator = ShardwiseAccelerator()  # on CPU Accelerate then takes each rank for a lone process
    if accelerator.num_processes == 2:
        return "accelerate saw both ranks"
    try:
        accelerator.prepare(model)
    except sw.ShardwiseError as error:
        return str(error)
    return None


def test_accelerate_that_sees_one_process_per_rank_is_refused(ranks):
    """Catches Accelerate taking every rank for a lone process (CPU without cpu=True): it then dealt
    every rank the same batches and the model trained on a quarter of the data, without a word."""
    for message in ranks.run(_prepare_without_cpu_flag, 2, timeout=120):
        assert message is not None and "cpu=True" in message, message

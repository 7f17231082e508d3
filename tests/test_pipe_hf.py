"""Hugging Face decoders cut into pipeline stages by `chain_layers` itself (issue 59 point 2, Note [Hugging Face
decoder layers] in models/hf_layers.py): built from configs, loaded from pretrained files, trained under
pipe 2 x zero3 2 against transformers' own forward in one process."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from helpers.hf_dirs import FAMILIES, config, model_class, tokens, write_pretrained
from helpers.pipe import GLOBAL_BATCH, MICRO, NUM_SAMPLES, batches_of, dataset, token_loss
from shardwise.pipeline import PipelineConfig, PipeTrainer, StickySampler, chain_layers, grouped_adamw
from shardwise.testing import RunResult, assert_close_runs, make_optimizer

pytest.importorskip("transformers")

STEPS = 4


VARIANTS = {"opt-projected": ("opt", dict(word_embed_proj_dim=16, do_layer_norm_before=False)),  # as opt-350m
            "phi-tied": ("phi", dict(tie_word_embeddings=True))}


@pytest.mark.parametrize("variant", sorted(FAMILIES) + sorted(VARIANTS))
def test_chain_of_a_hf_model_is_its_forward(variant):
    """Catches a cut that drops what transformers' forward does between layers: the causal mask, the rotary
    position embeddings (Llama, Qwen2, Phi) or learned positions (GPT-2; OPT's offset by 2), Phi's embedding
    dropout, OPT's projections in and out of a narrower embedding and its final norm when the config has none
    (opt-350m's layout), the final norm; and a tied head (Qwen2, GPT-2, OPT, a tied Phi) not recorded as one
    parameter held by the first and last layer. The chain's logits are bitwise model(input_ids).logits."""
    name, changes = VARIANTS.get(variant, (variant, {}))
    torch.manual_seed(0)
    model = model_class(name)(config(name, **changes)).eval()
    chain = chain_layers(model)
    hidden = tokens()
    with torch.no_grad():
        for layer in chain.layers:
            hidden = layer(hidden)
        assert torch.equal(hidden, model(input_ids=tokens()).logits)
    assert chain.num_layers == 2 + config(name).num_hidden_layers
    tied = model.config.tie_word_embeddings
    assert list(chain.tied().values()) == ([[0, chain.num_layers - 1]] if tied else [])


def test_other_hf_families_are_refused_with_the_fix():
    """Catches a Hugging Face model of another structure (BERT) cut wrong instead of refused, and an OPT that
    drops layers at random while training (LayerDrop) cut into fixed stages that never drop them."""
    import transformers

    bert = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                               num_attention_heads=2, intermediate_size=32))
    with pytest.raises(sw.ShardwiseError, match="pipeline_layers"):
        chain_layers(bert)
    with pytest.raises(sw.ShardwiseError, match="layerdrop"):
        chain_layers(model_class("opt")(config("opt", layerdrop=0.1)))


def _pretrained_model(name, directory):
    model = model_class(name)(config(name))
    assert sw.load(directory, model).ok
    return model


def _reference(name, directory) -> RunResult:
    """transformers' own forward, one process, the whole global batch per step."""
    model = model_class(name).from_pretrained(directory, dtype=torch.float32).train()
    inputs, targets = dataset(vocab=96)
    optimizer = make_optimizer(model)
    losses = []
    for batch in batches_of(StickySampler(NUM_SAMPLES, GLOBAL_BATCH, num_homes=4), STEPS):
        model.zero_grad(set_to_none=True)
        loss = token_loss(model(input_ids=inputs[batch]).logits, targets[batch])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return RunResult(losses, [], {n: p.detach().clone() for n, p in model.named_parameters()})


def _pipelined(name, directory, schedule, into_stages=False) -> RunResult:
    """`into_stages`: the pretrained rows loaded into the sharded stages (load_stages), not the whole model first."""
    from shardwise.pipeline import load_stages

    inputs, targets = dataset(vocab=96)
    pipe = PipelineConfig(num_stages=2, num_microbatches=MICRO, schedule=schedule, cache=False, strategy="zero3")
    model = model_class(name)(config(name)) if into_stages else _pretrained_model(name, directory)
    trainer = PipeTrainer(chain_layers(model), token_loss, grouped_adamw(eps=1e-3), inputs, targets,
                          global_batch_size=GLOBAL_BATCH, config=pipe)
    if into_stages:
        assert load_stages(directory, trainer.stage_module, names=trainer._local_names, group=trainer.group).ok
    losses = [trainer.step(b) for b in batches_of(trainer.sampler, STEPS)]
    return RunResult(losses, [], trainer.full_parameters())


@pytest.mark.parametrize("name, schedules", [("llama", ("gpipe", "1f1b")), ("qwen2", ("gpipe", "1f1b")),
                                             ("phi", ("gpipe",)), ("opt", ("1f1b",))])
def test_pretrained_hf_decoder_trains_in_pipe_by_shard_stages(ranks, tmp_path, name, schedules):
    """Catches an HF decoder that the pipeline does not take as it is (chain_layers refused it: Phi and OPT
    were), a stage whose decoder layers miss the mask or positions, and a tied embedding/head (Qwen2, OPT) not
    kept one value across the first and last stage: pipe 2 x zero3 2 at 4 ranks, loaded from pretrained files,
    equals transformers' forward in one process (fp32 1e-5 / 1e-6, DESIGN's bound)."""
    directory = write_pretrained(name, tmp_path / name, torch.float32)
    reference = _reference(name, directory)
    for schedule in schedules:
        for rank, result in enumerate(ranks.run(_pipelined, 4, name, directory, schedule, timeout=300)):
            try:
                assert_close_runs(reference, result)
            except AssertionError as error:
                raise AssertionError(f"{name} {schedule}, rank {rank}: {error}") from None


def test_plan_weighs_pipelines_of_a_hf_model(capsys):
    """Catches `shardwise plan --pipelines` skipping a Hugging Face decoder (chain_layers refused it, so no pipe x
    shard row was printed for it)."""
    from shardwise import cli

    spec = ["llama", "hidden_size=64", "num_hidden_layers=4", "intermediate_size=128", "vocab_size=256",
            "num_attention_heads=4"]
    assert cli.main(["plan", *spec, "--memory", "1GiB", "--world-size", "4", "--pipelines"]) == 0
    out = capsys.readouterr().out
    assert "pipe 2 x zero3 2" in out and "not weighed" not in out, out


def test_pretrained_rows_load_into_sharded_stages(ranks, tmp_path):
    """Catches a Hugging Face directory refused by, or loaded wrong into, a pipeline's sharded stages
    (load_stages: each stage its names, Qwen2's tie on both stages): pipe 2 x zero3 2 trains from the
    pretrained values equal to transformers' forward in one process."""
    directory = write_pretrained("qwen2", tmp_path / "qwen2", torch.bfloat16)
    reference = _reference("qwen2", directory)
    for rank, result in enumerate(ranks.run(_pipelined, 4, "qwen2", directory, "1f1b", True, timeout=300)):
        try:
            assert_close_runs(reference, result)
        except AssertionError as error:
            raise AssertionError(f"rank {rank}: {error}") from None


def _pipelined_export(name, directory, checkpoint, out):
    """Train pipe 2 x zero3 2 from the pretrained files, then export the documented way: save_pipeline, the same
    model class built deferred and sharded zero3 over every rank, sw.load of the checkpoint, sw.save_pretrained."""
    from shardwise.pipeline import save_pipeline

    inputs, targets = dataset(vocab=96)
    pipe = PipelineConfig(num_stages=2, num_microbatches=MICRO, schedule="1f1b", cache=False, strategy="zero3")
    trainer = PipeTrainer(chain_layers(_pretrained_model(name, directory)), token_loss, grouped_adamw(eps=1e-3),
                          inputs, targets, global_batch_size=GLOBAL_BATCH, config=pipe)
    for batch in batches_of(trainer.sampler, 2):
        trainer.step(batch)
    save_pipeline(checkpoint, trainer)
    with sw.deferred_init():
        model = model_class(name)(config(name))
    sw.shard(model, strategy="zero3")
    assert sw.load(checkpoint, model).ok
    sw.save_pretrained(model, out, max_shard_size="12KB")
    return trainer.full_parameters()


@pytest.mark.parametrize("name", ["qwen2", "opt"])
def test_pipelined_model_exports_to_what_from_pretrained_loads(ranks, tmp_path, name):
    """Catches a pipelined model's export (docs/pipeline.md's route: save_pipeline, then sw.load into the model
    sharded flat, then sw.save_pretrained) that from_pretrained loads other than what was trained: a stage's
    rows missing or another stage's stale values, a tied head (Qwen2, OPT) stored twice or from the wrong stage,
    one file past the size asked for."""
    directory = write_pretrained(name, tmp_path / name, torch.float32)
    out = tmp_path / "exported"
    trained = ranks.run(_pipelined_export, 4, name, directory, tmp_path / "ckpt", out, timeout=300)[0]
    assert len(list(out.glob("model-*.safetensors"))) >= 3 and (out / "model.safetensors.index.json").exists()
    loaded = model_class(name).from_pretrained(out)
    pretrained = model_class(name).from_pretrained(directory)
    params = dict(loaded.named_parameters())
    assert set(params) == set(trained)
    assert [n for n, p in params.items() if not torch.equal(p, trained[n])] == []
    assert any(not torch.equal(p, pretrained.get_parameter(n)) for n, p in params.items()), "nothing was trained"

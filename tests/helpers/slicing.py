"""Rank functions for the slicing tests (tests/test_slicing.py): one model sliced over a tensor
group and, on a 2-D mesh, sharded with zero3 over the data group, trained with the one loop
(shardwise.testing.train) and compared with the single process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shardwise as sw
from shardwise.engine import engine_of, slicing_of
from shardwise.engine.protocol import is_sliced_param
from shardwise.models.zoo import ZOO, ZooSpec
from shardwise.testing import RunResult, make_optimizer, train

LLAMA_VOCAB, LLAMA_SEQ = 128, 8


class LlamaLM(nn.Module):
    """A tiny Hugging Face Llama with the zoo's interface: forward(x, y) -> mean next-token loss.

    The loss is `F.cross_entropy` on the head's logits, so on a sliced model it runs on the
    vocabulary slices (Note [sliced logits])."""

    def __init__(self, kv_heads: int = 2) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads,
                             intermediate_size=128, num_hidden_layers=2, vocab_size=LLAMA_VOCAB,
                             max_position_embeddings=LLAMA_SEQ, attn_implementation="sdpa")
        self.lm = LlamaForCausalLM(config)
        self.seed = 0

    def begin_step(self, step: int) -> None:
        pass

    def forward(self, x, y):
        logits = self.lm(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class GPT2LM(LlamaLM):
    """A tiny Hugging Face GPT-2 (Conv1D layers, fused c_attn, tied wte/lm_head), zoo interface."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=LLAMA_VOCAB, n_positions=LLAMA_SEQ,
                            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            attn_implementation="sdpa")
        self.lm = GPT2LMHeadModel(config)
        self.seed = 0


class HFLossLM(nn.Module):
    """`inner`'s Hugging Face model trained through its own loss: `model(input_ids=x, labels=x).loss`
    (transformers shifts the labels and reshapes the logits itself; Note [hf loss])."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.lm, self.seed = inner.lm, 0

    def begin_step(self, step: int) -> None:
        pass

    def forward(self, x, y):
        return self.lm(input_ids=x, labels=x).loss


UNEVEN_VOCAB, UNEVEN_WIDTH, UNEVEN_HIDDEN = 10, 12, 30
UNEVEN_PLAN = {"emb": "vocab", "fc1": "colwise", "fc2": "rowwise", "head": "vocab"}


class UnevenLM(nn.Module):
    """Sizes no tensor group of 3 or 4 divides (vocabulary 10, hidden 30), an untied head, and
    ignored targets (-100): sliced with the explicit UNEVEN_PLAN."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(UNEVEN_VOCAB, UNEVEN_WIDTH)
        self.fc1 = nn.Linear(UNEVEN_WIDTH, UNEVEN_HIDDEN)
        self.fc2 = nn.Linear(UNEVEN_HIDDEN, UNEVEN_WIDTH)
        self.head = nn.Linear(UNEVEN_WIDTH, UNEVEN_VOCAB)
        self.seed = 0

    def begin_step(self, step: int) -> None:
        pass

    def forward(self, x, y):
        h = self.emb(x)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.masked_fill(y == 0, -100).reshape(-1))


def _uneven_batch(g: torch.Generator, n: int):
    seq = torch.randint(0, UNEVEN_VOCAB, (n, 7), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _llama_batch(g: torch.Generator, n: int):
    seq = torch.randint(0, LLAMA_VOCAB, (n, LLAMA_SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _hf_unit(name: str):
    if name == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        return GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    return LlamaDecoderLayer


MODELS = {
    "gpt": ZOO["gpt"],
    "llama": ZooSpec("llama", lambda: LlamaLM(2), _llama_batch, None, False),
    "llama_kv4": ZooSpec("llama_kv4", lambda: LlamaLM(4), _llama_batch, None, False),
    "gpt2": ZooSpec("gpt2", GPT2LM, _llama_batch, None, False),
    "uneven": ZooSpec("uneven", UnevenLM, _uneven_batch, None, False),
    "llama_labels": ZooSpec("llama_labels", lambda: HFLossLM(LlamaLM(2)), _llama_batch, None, False),
    "gpt2_labels": ZooSpec("gpt2_labels", lambda: HFLossLM(GPT2LM()), _llama_batch, None, False),
}
PLANS = {"uneven": UNEVEN_PLAN}  # the others use plan="auto"


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name].build()
    model.seed = seed
    return model


def reference(name: str, steps: int = 5, global_batch_size: int = 8, clip: float | None = None,
              norm_type: float = 2.0) -> RunResult:
    """One process, the whole global batch (gradients clipped to `clip` in `norm_type` if given)."""
    return train(build(name), MODELS[name], steps, global_batch_size, clip=clip,
                 clip_fn=lambda m, c: torch.nn.utils.clip_grad_norm_(m.parameters(), c, norm_type))


def _average(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t.item()


def run_mesh(name: str, data: int, tensor: int, strategy: str | None, steps: int = 5,
             global_batch_size: int = 8, clip: float | None = None, norm_type: float = 2.0,
             replicas: int = 1) -> RunResult:
    """On this rank of a data x tensor mesh: slice over "tensor", shard with `strategy` over "data"
    (None: no sharding), train; full (unsliced, unsharded) parameters at the end. `replicas` > 1:
    a replicate x shard x tensor mesh, `data` ranks per replica (Note [sliced mesh])."""
    model = build(name)
    ndim_by_name = {n: p.ndim for n, p in model.named_parameters()}
    tied = [(m.tok_emb, m.head) for m in [model] if name == "gpt"]
    mesh, data_rank, data_world = _slice_and_shard(model, name, data, tensor, True, strategy, replicas)
    for emb, head in tied:  # Note [tied params]: one Parameter after slicing and sharding, as before
        assert emb.weight is head.weight, "the tied embedding/head weight became two parameters"
    optimizer = make_optimizer(model, ndim_by_name=ndim_by_name)
    return train(model, MODELS[name], steps, global_batch_size, rank=data_rank, world_size=data_world,
                 optimizer=optimizer, all_reduce_loss=_average, gather_params=lambda: sw.full_parameters(model),
                 clip=clip, clip_fn=lambda m, c: sw.clip_grad_norm_(m, c, norm_type))


def _slice_and_shard(model: nn.Module, name: str, data: int, tensor: int, sliced: bool, strategy: str | None,
                     replicas: int = 1):
    """`model` sliced over "tensor" (when `sliced`) and `strategy` applied over the data ranks: a
    ("data", "tensor") mesh, or with `replicas` > 1 a ("replicate", "shard", "tensor") mesh that both
    calls take whole (hybrid sharding of the slices). The mesh, this rank's data rank and their number."""
    if replicas > 1:
        mesh = init_device_mesh("cpu", (replicas, data, tensor), mesh_dim_names=("replicate", "shard", "tensor"))
        data_rank = mesh["replicate"].get_local_rank() * data + mesh["shard"].get_local_rank()
        placement = {"mesh": mesh}
    else:
        mesh = init_device_mesh("cpu", (data, tensor), mesh_dim_names=("data", "tensor"))
        data_rank, placement = mesh["data"].get_local_rank(), {"process_group": mesh["data"].get_group()}
    if sliced:
        sw.slice(model, PLANS.get(name, "auto"), group=mesh)
    if strategy is not None and data * replicas > 1:
        units = MODELS[name].unit_class or (_hf_unit(name) if name.startswith(("llama", "gpt2")) else "auto")
        kwargs = {} if strategy == "ddp" else {"units": units}
        sw.shard(model, strategy=strategy, **placement, **kwargs)
    return mesh, data_rank, data * replicas


# ---- misuse: each returns this rank's ShardwiseError message (None if nothing was raised) ----------


def _message(fn) -> str | None:
    try:
        fn()
    except sw.ShardwiseError as error:
        return str(error)
    return None


def misuse(case: str) -> str | None:
    """Run misuse `case` on this rank; the ShardwiseError message it raised, or None."""
    from shardwise.models.gpt import GPT, GPTConfig

    world = dist.get_world_size()
    torch.manual_seed(0)
    if case == "heads_not_divisible":  # 3 heads over 2 ranks
        return _message(lambda: sw.slice(GPT(GPTConfig(d_model=24, n_heads=3))))
    if case == "kv_heads_not_divisible":  # Llama with 2 key/value heads over 4 ranks
        return _message(lambda: sw.slice(LlamaLM(2)))
    if case == "slice_after_shard":
        model = build("gpt")
        sw.shard(model, strategy="zero3")
        return _message(lambda: sw.slice(model))
    if case == "slice_twice":
        model = sw.slice(build("gpt"))
        return _message(lambda: sw.slice(model))
    if case == "missing_module":
        return _message(lambda: sw.slice(build("gpt"), {"blocks.*.mlp.0": "colwise", "blocks.*.fc9": "rowwise"}))
    if case == "bad_style":
        return _message(lambda: sw.slice(build("gpt"), {"blocks.*.mlp.0": "columnwise"}))
    if case == "two_entries":
        return _message(lambda: sw.slice(build("gpt"), {"blocks.*.mlp.0": "colwise", "blocks.0.mlp.0": "colwise"}))
    if case == "unnamed_2d_mesh":
        mesh = init_device_mesh("cpu", (1, world))
        return _message(lambda: sw.slice(build("gpt"), group=mesh))
    if case == "shard_over_tensor_ranks":  # slice over every rank, then zero3 over the same ranks
        model = sw.slice(build("gpt"))
        return _message(lambda: sw.shard(model, strategy="zero3"))
    if case in ("mesh3d_unsliced", "mesh3d_other_tensor_group"):  # Note [sliced mesh]
        mesh = init_device_mesh("cpu", (1, 2, world // 2), mesh_dim_names=("replicate", "shard", "tensor"))
        model = build("gpt")
        if case == "mesh3d_other_tensor_group":  # sliced over every rank, not over mesh["tensor"]
            sw.slice(model)
        return _message(lambda: sw.shard(model, strategy="zero3", mesh=mesh))
    if case == "tied_sliced_two_ways":
        return _message(lambda: sw.slice(build("gpt"), {"tok_emb": "vocab", "head": "rowwise"}))
    if case == "logits_argmax":
        model = sw.slice(build("gpt"))
        x, _ = MODELS["gpt"].make_batch(torch.Generator().manual_seed(0), 2)
        return _message(lambda: model(x).argmax(-1))
    if case == "logits_softmax":
        model = sw.slice(build("gpt"))
        x, _ = MODELS["gpt"].make_batch(torch.Generator().manual_seed(0), 2)
        return _message(lambda: F.softmax(model(x), dim=-1))
    if case == "different_inputs":  # each rank its own rows: a batch split over the tensor ranks
        model = sw.slice(build("gpt"))
        x, y = MODELS["gpt"].make_batch(torch.Generator().manual_seed(dist.get_rank()), 2)
        return _message(lambda: model(x, y))
    if case == "save_without_data_strategy":  # a 2 x 2 mesh sliced over "tensor", nothing over "data"
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("data", "tensor"))
        model = sw.slice(build("gpt"), group=mesh)
        import tempfile
        return _message(lambda: sw.save(tempfile.mkdtemp() + "/ckpt", model))
    if case == "deferred":
        with sw.deferred_init():
            model = GPT(GPTConfig())
        return _message(lambda: sw.slice(model))
    if case == "state_dict_of_sliced":
        return _message(lambda: sw.slice(build("gpt")).state_dict())
    if case == "pipeline_of_sliced":
        from shardwise.pipeline.layers import chain_layers
        return _message(lambda: chain_layers(sw.slice(build("gpt"))))
    raise KeyError(case)


def full_logits(name: str, tensor: int):
    """The sliced model's gathered logits and its logits' gradient path: (logits, loss of their sum of
    squares' gradient w.r.t. the embedding), to compare with one process."""
    model = build(name)
    if tensor:
        sw.slice(model)
    x, _ = MODELS[name].make_batch(torch.Generator().manual_seed(1), 2)
    logits = sw.gather_logits(model(x))
    logits.pow(2).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    values = sw.full_parameters(model) if tensor else {}
    if tensor:  # unslice the gradients the same way as the values
        from shardwise.parallel.slicing.full import unslice_values
        grads = unslice_values(model, grads)
    return logits.detach(), grads, values


def auto_plan_of(name: str) -> dict[str, str]:
    """The plan sw.slice(model) resolved for zoo/HF model `name`, as {module name: kind}."""
    model = sw.slice(build(name))
    return {module: spec.kind for module, spec in slicing_of(model).plan.items()}


# ---- checkpoints across mesh shapes ----------------------------------------------------------


def _layout(name: str, data: int, tensor: int, sliced: bool, strategy: str = "zero3", replicas: int = 1):
    """A fresh model on this rank's place in a data x tensor mesh: sliced over "tensor" when `sliced`,
    `strategy` over "data" when data > 1 (replicate x shard with `replicas` > 1); its optimizer and
    this rank's data rank and their number."""
    model = build(name)
    ndim_by_name = {n: p.ndim for n, p in model.named_parameters()}
    _, data_rank, data_world = _slice_and_shard(model, name, data, tensor, sliced, strategy, replicas)
    return model, make_optimizer(model, ndim_by_name=ndim_by_name), data_rank, data_world


def checkpoint_phase(name: str, data: int, tensor: int, sliced: bool, strategy: str, path: str, resume: bool,
                     steps: int = 3, replicas: int = 1) -> RunResult:
    """Save after `steps` steps in one layout, or (resume) load into another and train `steps` more."""
    model, optimizer, data_rank, data_world = _layout(name, data, tensor, sliced, strategy, replicas)
    if resume:
        sw.load(path, model, optimizer)
    result = train(model, MODELS[name], steps, 8, rank=data_rank, world_size=data_world, optimizer=optimizer,
                   all_reduce_loss=_average, gather_params=lambda: sw.full_parameters(model))
    if not resume:
        sw.save(path, model, optimizer)
    return result


def export_phase(name: str, data: int, tensor: int, path: str) -> dict:
    """sw.full_state_dict and sw.export of a sliced (and sharded) model, after one step."""
    model, optimizer, data_rank, _ = _layout(name, data, tensor, True)
    train(model, MODELS[name], 1, 8, rank=data_rank, world_size=data, optimizer=optimizer, all_reduce_loss=_average)
    state = sw.full_state_dict(model)
    sw.export(model, path)
    return {"state": state, "params": sw.full_parameters(model)}


def reference_resume(name: str, before: int = 3, after: int = 3) -> RunResult:
    """One process: `before` steps, then `after` more with the same model and optimizer (the data of
    steps 0.. again, as a resumed `train` sees it)."""
    model = build(name)
    optimizer = make_optimizer(model)
    train(model, MODELS[name], before, 8, optimizer=optimizer)
    return train(model, MODELS[name], after, 8, optimizer=optimizer)


# ---- bytes moved per step --------------------------------------------------------------------


def count_step(name: str, data: int, tensor: int, global_batch_size: int = 8) -> dict:
    """One training step's collectives on this rank (after a warm-up step), counted, and predicted."""
    from shardwise.parallel.slicing.traffic import count_collectives, predict_gpt

    model, optimizer, data_rank, _ = _layout(name, data, tensor, True)
    spec = MODELS[name]
    mesh_tensor = slicing_of(model).group
    train(model, spec, 1, global_batch_size, rank=data_rank, world_size=data, optimizer=optimizer)
    x, y = MODELS[name].make_batch(torch.Generator().manual_seed(5), global_batch_size)
    per = global_batch_size // data
    x, y = x[data_rank * per:(data_rank + 1) * per], y[data_rank * per:(data_rank + 1) * per]
    with count_collectives(mesh_tensor) as counted:
        model(x, y).backward()
        optimizer.step()
    cfg = model.cfg
    predicted = predict_gpt(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.mlp_ratio, x.shape[1], per,
                            data=data, tensor=tensor, tensor_rank=dist.get_rank(mesh_tensor))
    fields = ("data_gather", "data_reduce", "tensor_reduce", "wire_bytes")
    engine = engine_of(model)  # the layout holds the tensor dimension too (issue 43: one layout)
    layout = None if engine is None else {
        "dims": engine.mesh.dims(), "same_tensor_group": engine.mesh.tensor_group is mesh_tensor,
        "described": [line for line in str(sw.describe(model)).splitlines() if line.startswith("layout:")]}
    return {"counted": {f: getattr(counted, f) for f in fields},
            "predicted": {f: getattr(predicted, f) for f in fields}, "calls": dict(counted.calls), "layout": layout}


def train_precision(precision: str, steps: int, data: int = 2, tensor: int = 2) -> tuple[list[float], set[str]]:
    """Zoo GPT sliced over "tensor" and zero3 over "data" with `precision`; per-step global losses."""
    mesh = init_device_mesh("cpu", (data, tensor), mesh_dim_names=("data", "tensor"))
    model = build("gpt")
    ndim = {n: p.ndim for n, p in model.named_parameters()}
    sw.slice(model, group=mesh)
    sw.shard(model, strategy="zero3", units=MODELS["gpt"].unit_class, precision=precision,
             process_group=mesh["data"].get_group())
    optimizer = make_optimizer(model, ndim_by_name=ndim)
    result = train(model, MODELS["gpt"], steps, 8, rank=mesh["data"].get_local_rank(), world_size=data,
                   optimizer=optimizer, all_reduce_loss=_average)
    return result.losses, {str(p.dtype) for p in model.parameters()}


def fp16_overflow_on_one_tensor_rank() -> list[tuple[bool, bool]]:
    """2 x 2, fp16 with sw.LossScaler; in step 1 only global rank 1 (tensor rank 1 of data rank 0)
    sees an inf: every rank must skip that step. Per step: (step taken, parameters unchanged)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    model = sw.slice(build("gpt"), group=mesh)
    sw.shard(model, strategy="zero2", units=MODELS["gpt"].unit_class, precision="fp16",
             process_group=mesh["data"].get_group())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = sw.LossScaler(model, init_scale=1024.0)
    record = []
    for step in range(3):
        x, y = MODELS["gpt"].make_batch(torch.Generator().manual_seed(step), 8)
        rows = slice(mesh["data"].get_local_rank() * 4, mesh["data"].get_local_rank() * 4 + 4)
        scaler.scale(model(x[rows], y[rows])).backward()
        if step == 1 and dist.get_rank() == 1:
            next(p for p in model.parameters() if p.grad is not None and is_sliced_param(p)).grad[0] = \
                float("inf")
        before = sw.full_parameters(model)
        took = scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        after = sw.full_parameters(model)
        record.append((took, all(torch.equal(before[n], after[n]) for n in before)))
    return record

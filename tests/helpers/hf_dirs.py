"""Hugging Face "pretrained" model directories built here from configs (nothing is downloaded), written by
transformers' own `save_pretrained` in several files, and the one-process values `from_pretrained` gives."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 96
CONFIGS = {  # tiny: hidden 32, 2 layers; qwen2 ties lm_head to embed_tokens, gpt2 ties lm_head to wte
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2,
                                                      intermediate_size=64, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2,
                                                      intermediate_size=64, tie_word_embeddings=True)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                   n_positions=32, bos_token_id=0, eos_token_id=0)),
}
MORE_CONFIGS = {  # the other families chain_layers cuts (tests/test_pipe_hf.py); dropout off, as training compares
    "phi": ("PhiConfig", "PhiForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=64,
                                                max_position_embeddings=32)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, ffn_dim=64, max_position_embeddings=32,
                                                word_embed_proj_dim=32, dropout=0.0, pad_token_id=1)),
}
FAMILIES = {**CONFIGS, **MORE_CONFIGS}
SHARD_SIZE = "12KB"  # the tiny models' fp32 weights are 50-110 KB: 4+ files in bf16, more in fp32


def model_class(name: str):
    import transformers

    return getattr(transformers, FAMILIES[name][1])


def config(name: str, **changes):
    import transformers

    config_class, _, kwargs = FAMILIES[name]
    return getattr(transformers, config_class)(**{**kwargs, **changes})


def write_pretrained(name: str, directory: Path, dtype: torch.dtype, seed: int = 7) -> Path:
    """A model of `name` with random weights, written by `save_pretrained` in `dtype`, in several files."""
    torch.manual_seed(seed)
    model = model_class(name)(config(name)).to(dtype)
    model.save_pretrained(directory, max_shard_size=SHARD_SIZE)
    files = sorted(directory.glob("model-*.safetensors"))
    assert len(files) >= 3 and (directory / "model.safetensors.index.json").exists(), files
    return directory


def reference(name: str, directory: Path, tokens: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """What `from_pretrained` gives in one process, in fp32: every state dict value, and the logits on `tokens`."""
    model = model_class(name).from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, logits


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))


def index_of(directory: Path) -> dict:
    return json.loads((directory / "model.safetensors.index.json").read_text())


def rewrite_file(directory: Path, key: str, change) -> None:
    """Rewrite the file holding `key` with `change(tensors)` applied, and the index to match what it holds."""
    from safetensors.torch import load_file, save_file

    index = index_of(directory)
    file = index["weight_map"][key]
    tensors = load_file(directory / file)
    change(tensors)
    save_file(tensors, directory / file, metadata={"format": "pt"})
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if f != file}
    index["weight_map"].update({k: file for k in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def build_sharded(name, strategy, mesh_shape=None, **changes):
    """`name` built under sw.deferred_init() and sharded (a (replicate, shard) mesh of `mesh_shape` if given)."""
    import shardwise as sw

    with sw.deferred_init():
        model = model_class(name)(config(name, **changes))
    mesh = {}
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = {"mesh": init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))}
    return sw.shard(model, strategy=strategy, **mesh)


def rows_of(info, full):
    """This rank's rows of `full`, as `sw.shard_info`'s `info` places them."""
    return full.reshape(-1)[info.row_start:info.row_end] if full.dim() == 0 else full[info.row_start:info.row_end]


def load_and_compare(name, directory, strategy, expected, mesh_shape=None, path=None):
    """A rank function: sw.load `directory` (or `path`) into `name` sharded by `strategy`; (rank, the names whose
    rows differ from `expected` and "logits" when the logits differ from from_pretrained's, ok, notes)."""
    import torch.distributed as dist

    import shardwise as sw

    model = build_sharded(name, strategy, mesh_shape)
    report = sw.load(path or directory, model)
    differ = [n for n, info in sw.shard_info(model).items()
              if not torch.equal(info.rows.reshape(-1), rows_of(info, expected[n]).reshape(-1))]
    differ += [n for n, b in model.named_buffers() if n in expected and not torch.equal(b, expected[n])]
    # from_pretrained's logits in this process (one thread, as every rank): the parent's threads block
    # matmuls otherwise, which rounds differently.
    logits = reference(name, directory, tokens())[1]
    with torch.no_grad():
        got = model.eval()(input_ids=tokens()).logits  # as from_pretrained returns it: no dropout
        if not torch.equal(got, logits):
            differ.append(f"logits {(got - logits).abs().max().item():.3g}")
    return dist.get_rank(), differ, report.ok, report.notes

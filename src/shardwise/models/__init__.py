"""Small models used by the demo, tests and benchmarks: a GPT and the sharing-pattern zoo; and hf_layers.py,
Hugging Face decoders cut into pipeline layers (the model knowledge pipeline/layers.py's chain_layers asks for)."""

from .gpt import GPT, Block, GPTConfig
from .zoo import ZOO, ZooModel, ZooSpec, build, step_generator

__all__ = ["GPT", "Block", "GPTConfig", "ZOO", "ZooModel", "ZooSpec", "build", "step_generator"]

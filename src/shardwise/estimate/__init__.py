"""The memory estimator and planner (core.py, plan.py; largest.py, the largest model of a family that
fits), the activation probe (probe.py, with the inputs it feeds a model in inputs.py), and measure.py,
which counts the bytes a live job actually holds; pipe.py, a pipe x shard layout's per-rank cost.
Model-agnostic: what the probe must know of model families is in inputs.py."""

from shardwise.estimate.core import MemoryEstimate, estimate
from shardwise.estimate.largest import MaxModel, max_model
from shardwise.estimate.pipe import PipeEstimate, estimate_pipe
from shardwise.estimate.plan import PlanOption, plan
from shardwise.estimate.probe import ActivationProbe, probe_activations

__all__ = ["ActivationProbe", "MaxModel", "MemoryEstimate", "PipeEstimate", "PlanOption", "estimate", "estimate_pipe",
           "max_model", "plan", "probe_activations"]

"""The memory estimator and planner (core.py, plan.py), the activation probe (probe.py, with
the inputs it feeds a model in inputs.py), and measure.py, which counts the bytes a live job
actually holds. Model-agnostic: what the probe must know of model families is in inputs.py."""

from shardwise.estimate.core import MemoryEstimate, estimate
from shardwise.estimate.plan import PlanOption, plan
from shardwise.estimate.probe import ActivationProbe, probe_activations

__all__ = ["ActivationProbe", "MemoryEstimate", "PlanOption", "estimate", "plan", "probe_activations"]

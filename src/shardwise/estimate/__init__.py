"""The memory estimator and planner (core.py, plan.py), and measure.py, which counts
the bytes a live job actually holds. Model-agnostic: model knowledge comes through
shardwise.interfaces.ActivationSized."""

from shardwise.estimate.core import MemoryEstimate, estimate
from shardwise.estimate.plan import PlanOption, plan

__all__ = ["MemoryEstimate", "PlanOption", "estimate", "plan"]

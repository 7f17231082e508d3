"""The optimizer side: what the engine learns from a step, whole-tensor optimizers on owner
ranks (low-bit ones among them), stepping inside backward, the user's gradient helpers, and whole
replicas' gradient average.

Read in this order: optim_hooks.py (the step hooks) → whole_step.py (one owner per parameter)
(its collectives: comm/owner_traffic.py) → lowbit.py (quantized state: why it steps whole, how checkpoints
hold it) → step_in_backward.py → grads.py
(clipping and no_sync for users) → replica_grads.py (whole copies averaged: the pipeline's default route).
"""

"""The optimizer side: what the engine learns from a step, whole-tensor optimizers on owner
ranks, stepping inside backward, and the user's gradient helpers.

Read in this order: optim_hooks.py (the step hooks) → whole_step.py (one owner per parameter)
(its collectives: comm/owner_traffic.py) → step_in_backward.py → grads.py
(clipping and no_sync for users).
"""

"""When things happen: the forward/backward window and the order of every collective, as the stage
policies (unit/stage.py) answer.

Read in this order: window.py (a step's uses and its backward) → gather_schedule.py (forward and backward gathers,
prefetch) → reducer.py (the gradients' reduce order) → recompute.py (activation checkpointing)
→ agreement.py and consistency.py (what every rank must agree on, checked on the traffic).
"""

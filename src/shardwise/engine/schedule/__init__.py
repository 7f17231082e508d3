"""When things happen: the forward/backward window and the order of every collective, as the stage
policies (unit/stage.py) answer.

Read in this order: window.py (the window's states and checked transitions, GatherUnit) →
gather_schedule.py (forward and backward gathers, prefetch) → reducer.py (the gradients' reduce order) →
used_flags.py (which parameters any rank used) → recompute.py (activation checkpointing) → agreement.py and
consistency.py (what every rank must agree on, checked on the traffic) → driver.py (the hooks that run them all).
"""

"""When things happen: the stage policies, the forward/backward window and the order of every
collective.

Read in this order: stage.py (the zero1/zero2/zero3 policies) → phase.py (where a rank is) →
window.py (a step's uses and its backward) → gather_schedule.py (forward and backward gathers,
prefetch) → reducer.py (the gradients' reduce order) → recompute.py (activation checkpointing)
→ agreement.py and consistency.py (what every rank must agree on, checked on the traffic).
"""

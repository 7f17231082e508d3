"""The parallel layout: which ranks exist along which dimension, which rows of any tensor each
rank holds, and every process group the library uses.

Read in this order: parallel_layout.py (the layout object every other package asks) → rows.py (a tensor's
rows per rank) → groups.py (the one maker of process groups). Where a parameter's rows sit in a unit's flat
buffer is the unit's (unit/param_layout.py).
"""

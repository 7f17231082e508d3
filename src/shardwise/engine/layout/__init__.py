"""The parallel layout: which ranks exist along which dimension, which rows of any tensor each
rank holds, and every process group the library uses.

Read in this order: parallel_layout.py (the layout object every other package asks) → param_layout.py
(where each parameter's rows sit in a unit's flat buffer).
"""

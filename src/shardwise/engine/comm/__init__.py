"""How rows become full values and gradients become rows: the collectives the units issue.

Read: collectives.py (gathers into place, reduce-scatters, their pending handles and errors).
"""

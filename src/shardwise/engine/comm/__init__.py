"""How rows become full values and gradients become rows: the collectives the units issue.

Read: context.py (an engine's CommContext: what units ask, Note [comm context]) → streams.py (a stream per
kind of collective, an event per handle, through torch's device-generic API: Note [one device path],
Note [streams per collective]) → strategy.py (the form per backend) → collectives.py (gathers into place,
reduce-scatters, their pending handles and errors) → buffers.py (buffers reused across steps within a
bound) → small.py (headers, norms, flags) → owner_traffic.py (the whole-tensor step's gathers and
broadcasts).
"""

"""A load: every name matched and every byte it will apply checked, then the copy (Note [validate, then apply]).

Read in this order: load.py (`sw.load`: the agreements, then the apply) → sources.py (what a load reads from:
`open_source` tells the kinds apart; a checkpoint directory, a state dict; source_base.py their interface) →
hf_dir.py (a Hugging Face model directory or one safetensors file) → hf_names.py (transformers' names for
its keys, named in one call) → load_plan.py (the checks and the plan) → optim_plan.py (the optimizers' part:
pairing, class and settings checked, each state planned) → report.py (`LoadReport`) → reader.py (a
safetensors file's row ranges, read and checked where they land) → mapped.py (the verify phase's map).
"""

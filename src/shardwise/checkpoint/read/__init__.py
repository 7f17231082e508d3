"""A load: every name matched and every byte it will apply checked, then the copy (Note [validate, then apply]).

Read in this order: load.py (`sw.load`) → load_plan.py (the checks and the plan) → sources.py (what a load
reads from: a checkpoint directory, a safetensors file, a state dict; source_base.py their interface) →
hf_dir.py (a Hugging Face model directory) → hf_names.py (transformers' names for its keys) → report.py
(`LoadReport`) → reader.py (a safetensors file's row ranges, read and checked where they land) → mapped.py
(the verify phase's map).
"""

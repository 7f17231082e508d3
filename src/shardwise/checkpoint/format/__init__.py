"""What a checkpoint is on disk, and the checks that stand between its bytes and a model: both a save and a
load use these, and nothing here writes or reads a whole checkpoint.

Read in this order: records.py (what index.json says, as typed records) → schema.py (reading and checking
it: Note [index records]) → bounded_json.py (reading a JSON file that may be hostile) → files.py (the rank
files: safetensors, chunk checksums) → crc.py and sparse_crc.py (the checksum) → names.py (names in a
checkpoint) → values.py (scalars and RNG states) → optim_state.py (an optimizer's state as a checkpoint
holds it; what a load checks of it is read/optim_plan.py's) → model_config.py (a Hugging Face config
recorded at save) → ranks.py (which rank holds which rows, and the JSON collectives).
"""

"""Checkpoints and the world outside shardwise: a plain `model.safetensors` or a Hugging Face directory that
loads without shardwise, DTensor state for `torch.distributed.checkpoint`, and the CLI's offline tools.

Read in this order: export.py (`sw.export`) → hf_save.py (`sw.save_pretrained`: a Hugging Face directory,
one file or several) → pretrained.py (`sw.from_pretrained`:
a Hugging Face directory straight into shards) → dcp.py (`sw.dcp_state_dict`) →
tools.py (`shardwise ckpt inspect | export | diff`, with no model and no process group).
"""

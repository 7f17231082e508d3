"""Checkpoints: `sw.save` (and `sw.save_async`), `sw.load`, `sw.export`, `sw.latest`, and `sw.dcp_state_dict`.

Read in this order: save.py (the format and Note [atomic save]) → index.py → schema.py (index.json
as typed, checked records) → load.py and load_plan.py (Note [validate, then apply]) → sources.py
(what a load reads from) → files.py (safetensors I/O, checksums). names.py, ranks.py, values.py,
optim_state.py, bounded_json.py and sparse_crc.py are the small pieces both sides share; owner.py
and publish.py keep a save's directories its own (Note [save ownership]); tools.py backs
`shardwise ckpt inspect|export|diff`.
"""

from shardwise.checkpoint.background import PendingSave, save_async
from shardwise.checkpoint.dcp import dcp_state_dict
from shardwise.checkpoint.export import export, full_state_dict, save_pretrained
from shardwise.checkpoint.index import latest
from shardwise.checkpoint.load import load
from shardwise.checkpoint.report import LoadReport
from shardwise.checkpoint.save import save

__all__ = ["LoadReport", "PendingSave", "dcp_state_dict", "export", "full_state_dict", "latest", "load", "save",
           "save_async", "save_pretrained"]

"""Checkpoints: `sw.save` (and `sw.save_async`), `sw.load`, `sw.export`, `sw.latest`, and `sw.dcp_state_dict`.

Four rooms, each importing only the ones before it:
format/ (what a checkpoint is on disk, and its checks) → write/ (a save, from the ranks' rows to a
published directory) → read/ (a load: every check first, then the copy) → interop/ (the world outside
shardwise: plain safetensors and Hugging Face exports, DCP, the CLI's offline tools). Start with
write/save.py's docstring (the format and Note [atomic save]), then read/load.py (Note [validate, then
apply]); each room's __init__ gives its own reading order.
"""

from shardwise.checkpoint.interop.dcp import dcp_state_dict
from shardwise.checkpoint.interop.export import export, full_state_dict
from shardwise.checkpoint.interop.hf_save import save_pretrained
from shardwise.checkpoint.interop.pretrained import from_pretrained
from shardwise.checkpoint.read.load import load
from shardwise.checkpoint.read.report import LoadReport
from shardwise.checkpoint.write.background import PendingSave, save_async
from shardwise.checkpoint.write.index import latest
from shardwise.checkpoint.write.save import save

__all__ = ["LoadReport", "PendingSave", "dcp_state_dict", "export", "from_pretrained", "full_state_dict", "latest",
           "load", "save", "save_async", "save_pretrained"]

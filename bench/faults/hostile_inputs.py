"""Time and peak RSS of shardwise on oversized hostile inputs (issue 35 finding 11): each case runs in a
fresh process, measured with os.wait4 (peak RSS of that process, Python and torch included: ~270 MB).

    python bench/faults/hostile_inputs.py                      # this checkout
    PYTHONPATH=/path/to/other/src python bench/faults/hostile_inputs.py   # another version, same inputs

Cases: `latest` (sw.latest beside a 64 MiB `[{},{},...]` index.json), `load-header` (sw.load of a
checkpoint whose rank-file header is 99 MiB of `{}`, index forged to match), `inspect-sparse` (the
digest `ckpt inspect` computes of a 4 KiB sparse file declaring one row of 2^28 floats),
`suggest` (sw.load strict=False of 20,000 unmatched names into 20 parameters), `diff-values`
(`ckpt diff --values` of two 256 MiB tensors), `diff-row` (the same of two 256 MiB tensors of one row,
[1, 2^26]). Prints one line per case; measures, asserts nothing.

    python bench/faults/hostile_inputs.py diff-values diff-row   # some cases only
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TIMEOUT_S = 150
CASES = {
    "latest": "sw.latest(root / 'latest')",
    "load-header": "sw.load(root / 'header', nn.Linear(4, 4))",
    "inspect-sparse": "from shardwise.checkpoint.read.reader import file_digest; "
                      "file_digest(root / 'sparse.safetensors')",
    "suggest": "sw.load(root / 'names.safetensors', nn.Sequential(*[nn.Linear(1, 1, bias=False) for _ in range(20)]), "
               "strict=False)",
    "diff-values": "from shardwise.checkpoint.interop import tools; "
                   "tools.diff(root / 'a.safetensors', root / 'b.safetensors', values=True)",
    "diff-row": "from shardwise.checkpoint.interop import tools; tools.diff(root / 'row-a.safetensors', "
                "root / 'row-b.safetensors', values=True)",
}


def make_inputs(root: Path) -> None:
    import safetensors.torch
    import torch
    from torch import nn

    import shardwise as sw

    (root / "latest").mkdir()
    sw.save(root / "latest" / "good", nn.Linear(4, 4), step=1)
    (root / "latest" / "bomb").mkdir()
    (root / "latest" / "bomb" / "index.json").write_bytes(b"[" + b"{}," * (21 * 2**20) + b"{}]")
    checkpoint = sw.save(root / "header", nn.Linear(4, 4), step=1)
    rank_file = checkpoint / "rank-00000-of-00001.safetensors"
    data = rank_file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8 : 8 + length]))[:-1] + ',"junk":[' + "{}," * (33 * 2**20) + "{}]}"
    raw = header.encode() + b" " * (-len(header.encode()) % 8)
    rank_file.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + length :])
    index = json.loads((checkpoint / "index.json").read_text())
    index["files"][rank_file.name]["bytes"] = rank_file.stat().st_size
    body = json.dumps({k: v for k, v in index.items() if k != "digest"}, sort_keys=True, separators=(",", ":"))
    index["digest"] = "sha256:" + hashlib.sha256(body.encode()).hexdigest()
    (checkpoint / "index.json").write_text(json.dumps(index))
    count = 2**28
    head = json.dumps({"x": {"dtype": "F32", "shape": [1, count], "data_offsets": [0, 4 * count]}}).encode()
    head += b" " * (-len(head) % 8)
    with open(root / "sparse.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        f.truncate(8 + len(head) + 4 * count)
    safetensors.torch.save_file({f"encoder.blocks.{i}.attention.weights": torch.zeros(1) for i in range(20_000)},
                                root / "names.safetensors")
    safetensors.torch.save_file({"x": torch.zeros(8192, 8192)}, root / "a.safetensors")
    safetensors.torch.save_file({"x": torch.ones(8192, 8192)}, root / "b.safetensors")
    safetensors.torch.save_file({"x": torch.zeros(1, 2**26)}, root / "row-a.safetensors")
    safetensors.torch.save_file({"x": torch.ones(1, 2**26)}, root / "row-b.safetensors")


def measure(root: Path, case: str) -> str:
    code = ("import time, pathlib, torch; from torch import nn; import shardwise as sw\n"
            f"root = pathlib.Path({str(root)!r}); start = time.monotonic()\n"
            f"try:\n    {CASES[case]}\n    outcome = 'ok'\n"
            "except Exception as e:\n    outcome = type(e).__name__\n"
            "print(outcome, round(time.monotonic() - start, 2))")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    timer = threading.Timer(TIMEOUT_S, process.kill)  # a case still running then is reported as such
    timer.start()
    _, _, usage = os.wait4(process.pid, 0)
    timer.cancel()
    lines = process.stdout.read().strip().splitlines()
    outcome, seconds = lines[-1].split() if lines else (f"killed at {TIMEOUT_S} s", TIMEOUT_S)
    return f"{case:15s} {outcome:18s} {float(seconds):7.2f} s  peak RSS {usage.ru_maxrss / 1024:7.0f} MiB"


def main() -> None:
    if sys.argv[1:2] == ["--make"]:
        make_inputs(Path(sys.argv[2]))
        return
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        started = time.monotonic()
        # In a process of its own: a child's peak RSS starts at its parent's when it forks (kernel accounting),
        # so this process must stay small.
        subprocess.run([sys.executable, __file__, "--make", str(root)], check=True)
        print(f"inputs made in {time.monotonic() - started:.0f} s under {root}", flush=True)
        for case in sys.argv[1:] or CASES:
            print(measure(root, case), flush=True)


if __name__ == "__main__":
    main()

"""Where `sw.from_pretrained`'s load goes, counted (not timed: counts hold on a loaded host), against
`from_pretrained` + `sw.shard` on every rank; one rank's counts of each arm.

    python bench/checkpoints/hf_load_counts.py                                    # 2 ranks, hf_load.py's Llama
    python bench/checkpoints/hf_load_counts.py --hidden 64 --layers 2 --vocab 512  # the smallest

For each arm, rank 0 counts while it loads: the elements random initializers drew (`normal_`, `uniform_`, ...:
values the files overwrite), the bytes of fresh tensors made (factories: `empty`, `zeros`, ...) and of copies
(`copy_`, `_to_copy`), its read syscalls and the bytes they read (/proc/self/io `syscr`, `rchar`), its minor
page faults (a mapped file's pages touched), and cProfile's calls of the functions it spent most in. Issue 59's
question: why did loading take 5.4 s against 1.8 s (bench/checkpoints/results/hf_load.md)?
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.checkpoints.hf_load import load_arm, model_parser, write_pretrained  # noqa: E402

ARMS = ("shardwise", "from_pretrained+shard")
_RANDOM = {"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "randn", "rand", "randint", "randperm"}
_FACTORIES = {"empty", "empty_strided", "zeros", "ones", "full", "empty_like", "zeros_like", "new_empty"}
_COPIES = {"copy_", "_to_copy", "clone"}


def _io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def counting_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Counts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = {"random_elements": 0, "fresh_bytes": 0, "copied_bytes": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            real = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.device.type != "meta"]
            size = sum(t.numel() for t in real)
            if name in _RANDOM:
                self.counts["random_elements"] += size
            elif name in _FACTORIES:
                self.counts["fresh_bytes"] += sum(t.numel() * t.element_size() for t in real)
            elif name in _COPIES:
                self.counts["copied_bytes"] += sum(t.numel() * t.element_size() for t in real)
            return out

    return Counts()


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    import shardwise as sw

    torch.set_num_threads(1)
    sw.init()
    transformers.LlamaForCausalLM  # noqa: B018 (transformers imports it lazily: not part of the load)
    dist.barrier()
    before_io, before_faults = _io(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    profile, mode = cProfile.Profile(), counting_mode()
    with mode:
        profile.enable()
        load_arm(args, dist.get_rank())
        profile.disable()
    after_io = _io()
    if dist.get_rank() == 0:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        counts = {**mode.counts, "read_syscalls": after_io["syscr"] - before_io["syscr"],
                  "read_bytes": after_io["rchar"] - before_io["rchar"],
                  "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before_faults,
                  "profile": text.getvalue()}
        Path(args.out).write_text(json.dumps(counts))
    sw.shutdown()


def launcher(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory, fp32_mib, files = write_pretrained(args, Path(tmp))
        lines = [f"Llama, {fp32_mib:.0f} MiB in fp32, bf16 in {files} files, {args.world} ranks; rank 0's counts", "",
                 "| arm | random elements drawn | fresh tensor MiB | copied MiB | read syscalls | MiB read | "
                 "minor faults |", "|---|---|---|---|---|---|---|"]
        profiles = []
        for arm in args.arms:
            out = Path(tmp) / f"{arm}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(args.world), __file__, "--worker", "--arm", arm, "--dir", str(directory), "--out", str(out),
                       "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab),
                       "--top", str(args.top)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
            subprocess.run(command, check=True, timeout=3600, env=env, stdout=subprocess.DEVNULL)
            c = json.loads(out.read_text())
            lines.append(f"| {arm} | {c['random_elements']:,} | {c['fresh_bytes'] / 2**20:.1f} | "
                         f"{c['copied_bytes'] / 2**20:.1f} | {c['read_syscalls']:,} | {c['read_bytes'] / 2**20:.1f} | "
                         f"{c['minor_faults']:,} |")
            profiles.append(f"\n{arm}, the {args.top} functions with the most own time (rank 0):\n{c['profile']}")
    print("\n".join(lines) + "\n" + "".join(profiles))


def parse_args(argv=None):
    parser = model_parser(__doc__, 2, ARMS)
    parser.add_argument("--top", type=int, default=12, help="functions of cProfile's table per arm")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parsed = parse_args()
    worker(parsed) if parsed.worker else launcher(parsed)

"""Run under torchrun by tests/test_data_resume.py: `--total` batches of one epoch of a multi-worker
StatefulDataLoader, saved after `--save-at` batches (and going on), or resumed from `--path`."""

import argparse
import json
import warnings

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import shardwise as sw

warnings.filterwarnings("ignore")
parser = argparse.ArgumentParser()
parser.add_argument("--path", default="")
parser.add_argument("--save-at", type=int, default=None)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--total", type=int, default=7)
parser.add_argument("--out", required=True)
args = parser.parse_args()

sw.init(timeout=60)
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
sw.shard(model, strategy="zero2")
data = torch.arange(96).float().reshape(48, 2)
sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank(), seed=3)
loader = StatefulDataLoader(data, batch_size=3, sampler=sampler, num_workers=2)
seen, error = [], None
try:
    if args.resume:
        sw.load(args.path, model, loader=loader)
    for batch in loader:
        seen.append(batch[:, 0].tolist())
        if args.save_at is not None and len(seen) == args.save_at:
            sw.save(args.path, model, loader=loader)
        if len(seen) == args.total:
            break
except sw.ShardwiseError as exc:
    error = str(exc)
with open(f"{args.out}.{dist.get_rank()}", "w") as f:
    json.dump({"seen": seen, "error": error}, f)
sw.shutdown()

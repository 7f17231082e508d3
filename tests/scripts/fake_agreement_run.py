"""Run by tests/test_agreement_fake_gpu.py: zero1/2/3 steps on the fake accelerator (Note [fake accelerator],
helpers/fake_cuda.py) with the headers and zero3's tags in their device form (Note [headers on the device],
Note [tags on the device]) and the used-parameter flags in theirs (Note [used flags on the device]), as NCCL runs
take them; prints one `REPORT {json}` line per scenario: fake_gpu_run's report, plus the host waits of the headers,
tags and flags, the collectives of host tensors by caller and the headers compared, over the counted steps.

The fake process group's collectives mirror this rank, so a header's or tag's rows are this rank's row on every
rank, and the flags' OR is this rank's flags; their host copies have no values (fake tensors), so `rows_of` and
`result_of` read what this rank sent, as the mirror would have filled it (fake_gpu_run does it for every scenario).
A non-blocking device-to-host copy does not make the host wait (the read comes at the settle, or the flags'
agreement, counted there); a blocking one counts (helpers/fake_gpu.py's `_to_host`)."""

from __future__ import annotations

import collections
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fake_gpu_run beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import fake_gpu_run  # noqa: E402  (installs the fake accelerator)
import torch.distributed as dist  # noqa: E402
from fake_gpu_run import _adamw, _counted, _model, _step  # noqa: E402
from torch import nn  # noqa: E402

import shardwise as sw  # noqa: E402
import shardwise.engine.schedule.agreement_device as agreement_device  # noqa: E402
import shardwise.engine.schedule.gather_tags as gather_tags  # noqa: E402
import shardwise.engine.schedule.used_flags as used_flags  # noqa: E402
from helpers import fake_gpu  # noqa: E402
from shardwise.engine import engine_of  # noqa: E402

# True / False: the device / host forms of the headers and flags forced (the plain fake world reads as no device
# backend; False: this tree before Note [headers on the device] on NCCL), zero3's tags on the device either way;
# None: every form as the group's backends say (Note [group backends]: a MIXED world reads as "cpu:gloo,cuda:nccl")
FORMS = [True]


def _forced(real, tags: bool = False):
    return lambda group: real(group) if FORMS[0] is None else (True if tags else FORMS[0])


agreement_device.on_device = _forced(agreement_device.on_device)
used_flags.on_device = _forced(used_flags.on_device)
gather_tags.on_device = _forced(gather_tags.on_device, tags=True)

HOST_CALLS: collections.Counter = collections.Counter()
COUNTING = [False]


def _count_host_groups() -> None:
    """Every collective of the counted steps whose tensors are all on the host, by its shardwise caller: on NCCL
    it runs on a gloo group beside it (Note [host values]), a rendezvous of the ranks' CPUs."""
    for name in ("all_gather_single", "all_gather_into_tensor", "all_reduce", "all_gather", "broadcast",
                 "reduce_scatter_tensor"):
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            tensors = fake_gpu.tensors_of(args, kwargs)
            if COUNTING[0] and tensors and all(t.device.type == "cpu" for t in tensors):
                HOST_CALLS[f"{_name} at {fake_gpu._caller()}"] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)


_count_host_groups()


class Skipping(fake_gpu_run.Tiny):
    """Tiny whose second block no rank uses: its flags are read on the host every step (the allowance)."""

    def forward(self, tokens):
        x = self.blocks[0](self.embed(tokens))
        logits = self.norm(x) @ self.embed.weight.t()
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def train(strategy: str, on_device: bool | None = True, cls=fake_gpu_run.Tiny):
    """fake_gpu_run.train with the engine's header, tag and flag counters read over the counted steps
    (`on_device`: the headers' and flags' device forms, False their host forms, None as the group says)."""
    model = _model(cls)
    FORMS[0] = on_device
    sw.shard(model, strategy=strategy, units=fake_gpu_run.Block)
    engine = engine_of(model)
    agreement, tags, flags = engine.agreement, engine.driver.gathers.tags, engine.reducer.flags
    if on_device is not None:
        assert isinstance(agreement, agreement_device.HeadersOnDevice) == on_device, type(agreement)
        assert isinstance(flags, used_flags.UsedFlagsOnDevice) == on_device, type(flags)
    compared = [0]
    real_check = agreement.check

    def check(rows, order):
        compared[0] += 1
        return real_check(rows, order)

    agreement.check = check
    step = _step(model, _adamw(model))
    step()  # set-up: first calls
    counters = (agreement.host_waits, tags.host_waits if tags is not None else 0, compared[0], flags.host_waits)
    COUNTING[0] = True
    try:
        checks = _counted(step)
    finally:
        COUNTING[0] = False
    steps = fake_gpu_run.STEPS
    TOTALS.update(header_waits=(agreement.host_waits - counters[0]) / steps,
                  tag_waits=((tags.host_waits if tags is not None else 0) - counters[1]) / steps,
                  headers_compared=(compared[0] - counters[2]) / steps, tagged=tags is not None,
                  flag_waits=(flags.host_waits - counters[3]) / steps)
    return checks


TOTALS: dict = {}
SCENARIOS = {f"{strategy}-ws{ws}": (ws, lambda s=strategy: train(s))
             for strategy in ("zero1", "zero2", "zero3") for ws in (2, 4)}
SCENARIOS.update({f"{strategy}-ws2-host-headers": (2, lambda s=strategy: train(s, on_device=False))
                  for strategy in ("zero1", "zero2", "zero3")})
SCENARIOS.update({f"{strategy}-ws2-unused": (2, lambda s=strategy: train(s, cls=Skipping))
                  for strategy in ("zero2", "zero3")})
# the group `sw.init(backend="cpu:gloo,cuda:nccl")` makes, the forms not forced (Note [group backends])
SCENARIOS.update({f"zero3-ws{ws}-mixed": (ws, lambda: train("zero3", on_device=None), fake_gpu.MIXED)
                  for ws in (2, 4)})

if __name__ == "__main__":
    fake_gpu_run.SCENARIOS.update({f"device-headers-{name}": scenario for name, scenario in SCENARIOS.items()})
    for scenario_name in sys.argv[1:]:
        HOST_CALLS.clear()
        TOTALS.clear()
        try:
            report = fake_gpu_run.run(f"device-headers-{scenario_name}")
        except Exception as error:  # reported, not raised
            report = {"ok": False, "error": "".join(traceback.format_exception(error))[-3000:]}
        report.update(name=scenario_name, host_calls=dict(HOST_CALLS), **TOTALS)
        print("REPORT " + json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)  # torch's autograd device threads of the fake accelerator abort at interpreter exit

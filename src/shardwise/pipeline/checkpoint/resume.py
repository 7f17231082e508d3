"""What a pipeline checkpoint records of its run beside the model, and the check that a trainer resuming it
continues that run: the frozen prefix, and the order of the data.

Note [the frozen prefix in a checkpoint]: a re-packing freeze (`PipeTrainer.freeze`, repack.py) takes
layers [0, k) out of the stages: they are whole on every rank, in no stage module. `save_pipeline` writes
them too (`frozen_prefix`, saved by every rank an equal split of their rows, so once) and records k;
`load_pipeline` freezes the same k layers of a trainer built afresh, then loads every stage's rows and the
whole prefix on every rank, a tie frozen into both (the prefix's copy and the head stage's frozen shard)
filled from the one saved tensor.

Note [data order across world sizes]: the trainer's batches are `StickySampler.batches(epoch)`, a function of
(seed, number of samples, global batch size, num_homes), and num_homes defaults to the world size (each
replica's samples come back to it every epoch, for the activation cache). So a pipe 2 x 2 run resumed at 2
ranks would see other batches (issue 60: step-4 loss 4.8428 against 4.8276). The checkpoint records the
sampler's four numbers; a trainer whose sampler differs is refused on every rank before anything loads,
naming the fix: `PipeTrainer(..., num_homes=H)` with the saved H keeps the global order at any world size
that divides H (`sw.ResumableSampler` keeps it so for flat training).
"""

from __future__ import annotations

import torch

from shardwise.checkpoint.read.sources import open_source
from shardwise.errors import ShardwiseError

PIPELINE_KEY = "pipeline"  # a pipeline checkpoint's extra value: {"num_frozen": k, "sampler": {...}}


def run_record(trainer) -> dict:
    """What `save_pipeline` records of the trainer's run (JSON)."""
    return {"num_frozen": trainer.layout.num_frozen, "sampler": _sampler_of(trainer)}


def frozen_prefix(trainer) -> dict[str, torch.Tensor]:
    """The frozen prefix a re-pack took out of the stages: whole on every rank, alike (repack.py)."""
    chain, layout = trainer.chain, trainer.layout
    return {n: p.detach() for n, p in chain.params.items() if layout.stage_of_layer(chain.owner_layer(n)) is None}


def check_resume(path, trainer) -> int:
    """Refuse a trainer that would not continue the saved run (Note [data order across world sizes]); return
    how many leading layers the run had frozen (0 for a checkpoint of a flat model, which records nothing)."""
    source = open_source(path, lambda name: name)
    try:
        record = source.extra.get(PIPELINE_KEY)
    finally:
        source.close()
    if record is None:
        return 0
    num_frozen = record.get("num_frozen") if isinstance(record, dict) else None
    if not isinstance(num_frozen, int) or not 0 <= num_frozen < trainer.chain.num_layers:
        raise ShardwiseError(f"{path}: the saved {PIPELINE_KEY} record {record!r} names no frozen prefix of this "
                             f"model's {trainer.chain.num_layers} layers: load it into the model it was saved from")
    if num_frozen < trainer.layout.num_frozen:
        raise ShardwiseError(f"{path} was saved with {num_frozen} frozen layers and this trainer has frozen "
                             f"{trainer.layout.num_frozen} (a frozen prefix only grows): load it into a trainer built "
                             "afresh, before any freeze()")
    saved, mine = record.get("sampler"), _sampler_of(trainer)
    if isinstance(saved, dict) and saved != mine:
        differ = ", ".join(f"{key} {saved.get(key)} (this trainer: {value})" for key, value in mine.items()
                           if saved.get(key) != value)
        raise ShardwiseError(
            f"{path} was saved by a run whose batches came from another sampler ({differ}): resumed here, the "
            f"steps after it would train on other batches than the run's. Build the trainer with the same data, "
            f"global_batch_size and seed, and num_homes={saved.get('num_homes')} (PipeTrainer(..., num_homes=...), "
            "which keeps the run's global batches at any world size dividing it; it defaults to the world size)")
    return num_frozen


def _sampler_of(trainer) -> dict:
    sampler = trainer.sampler
    return {"num_samples": len(trainer.inputs), "global_batch_size": sampler.global_batch_size,
            "num_homes": sampler.num_homes, "seed": sampler.seed}

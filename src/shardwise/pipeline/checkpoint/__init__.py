"""Checkpoints of a pipeline with sharded stages: one `sw.save` directory of the whole model, any layout.

Read in this order: stages.py (`save_stages` / `load_stages`, and `save_pipeline` / `load_pipeline` for a
`PipeTrainer`: Note [stage checkpoints]) → resume.py (what a trainer's checkpoint records of its run: the
frozen prefix and the sampler, and the check that a resume continues it).
"""

from shardwise.pipeline.checkpoint.stages import load_pipeline, load_stages, save_pipeline, save_stages

__all__ = ["load_pipeline", "load_stages", "save_pipeline", "save_stages"]

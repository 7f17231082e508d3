"""Integrations with the trainers people already use; each imports its framework, so import
the one you need: `from shardwise.integrations.transformers import ShardwiseTrainer`."""

"""The package version, in one place (pyproject.toml reads it; checkpoints record it)."""

__version__ = "0.1.0"

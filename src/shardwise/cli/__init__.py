"""The `shardwise` command line (main.py); nothing in the library imports it."""

from shardwise.cli.main import main

__all__ = ["main"]

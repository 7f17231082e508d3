"""The `shardwise` command and the demo's argument handling (no training here)."""

import subprocess
import sys

from shardwise import cli, demo


def test_help_lists_the_commands(capsys):
    """Catches a broken console entry point or a subcommand missing from --help."""
    assert cli.main([]) == 0
    assert "demo" in capsys.readouterr().out


def test_console_script_runs():
    """Catches pyproject's `shardwise` script pointing at a function that does not exist."""
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and "shardwise" in done.stdout


def test_demo_rejects_an_unknown_strategy(capsys):
    """Catches a typo in --strategy launching ranks that then fail deep inside shard()."""
    assert demo.main(["--strategy", "zero9"]) == 2
    assert "zero9" in capsys.readouterr().err


def test_demo_text_is_the_same_everywhere():
    """Catches the demo's data depending on something other than the stdlib's own files."""
    text = demo.load_text(max_bytes=10_000)
    assert text.shape == (10_000,) and int(text.max()) < demo.BYTE_VOCAB
    x, y = demo.global_batch(text, step=3, size=4, seq=16)
    assert torch_equal(x[:, 1:], y[:, :-1])


def torch_equal(a, b):
    return bool((a == b).all())

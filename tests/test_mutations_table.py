"""bench/correctness/mutations.py stays runnable: every mutation's text is found once in its function."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the bench folders import as `bench.` (bench/README.md)

from bench.correctness import mutations  # noqa: E402


def test_every_mutation_finds_its_line():
    """Catches a refactor that rewrites or removes a line a mutation changes (the mutation would
    report "text found 0 times" only when someone runs the slow bench): name the function and
    marker to update in bench/correctness/mutations.py."""
    lost = {name: mutations.locate(ROOT / "src" / "shardwise", function, old)
            for name, function, old, _, _ in mutations.MUTATIONS}
    assert {name: why for name, why in lost.items() if isinstance(why, str)} == {}


def test_the_locator_refuses_a_missing_or_repeated_marker(tmp_path):
    """Catches a locator that cannot fail."""
    (tmp_path / "a.py").write_text("def f():\n    x = 1\n    x = 1\n\n\ndef g():\n    y = 2\n")
    assert mutations.locate(tmp_path, "f", "x = 1") == "text found 2 times in f"
    assert mutations.locate(tmp_path, "g", "x = 1") == "text found 0 times in g"
    path, start, end = mutations.locate(tmp_path, "g", "y = 2")
    assert path.read_text()[start:end] == "y = 2"

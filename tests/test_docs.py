"""The documentation site builds without a warning, and its API reference covers the public API.

`make docs` builds the same site into build/site; here it goes to a temporary directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import shardwise as sw

ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_strict_without_warnings(tmp_path):
    """Catches a broken page or link, a docstring mkdocstrings cannot render, or an API reference
    entry for a name that no longer exists: `mkdocs build --strict` turns each into a warning and
    fails (about 10 s)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "WARNING" not in output, output[-4000:]
    assert (tmp_path / "reference" / "shardwise" / "index.html").is_file()


def test_api_reference_lists_every_public_name():
    """Catches a name added to `shardwise.__all__` that the API reference never shows. A function
    that shares its name with the module defining it (`sw.save` in checkpoint/write/save.py) is listed
    under that module's path, which mkdocstrings resolves without the clash."""
    page = (ROOT / "docs" / "reference" / "shardwise.md").read_text()
    listed = set(re.findall(r"^::: (\S+)$", page, re.MULTILINE))
    missing = []
    for name in sw.__all__:
        value = getattr(sw, name)
        places = {f"shardwise.{name}"}
        if hasattr(value, "__module__") and hasattr(value, "__qualname__"):
            module = value.__module__
            places |= {f"{module}.{name}", f"{module.rpartition('.')[0]}.{name}"}
        if not places & listed:
            missing.append(name)
    assert missing == [], f"add to docs/reference/shardwise.md: {missing}"


def test_api_entries_under_internal_paths_are_titled_by_their_public_name():
    """Catches the API reference titling `sw.save` or `sw.plan` by the internal path it is listed
    under (`shardwise.checkpoint.write.save.save`): every public name not written `::: shardwise.<name>`
    sets its heading (and table-of-contents label) to `sw.<name>`."""
    page = (ROOT / "docs" / "reference" / "shardwise.md").read_text()
    untitled = []
    for match in re.finditer(r"^::: (\S+)\n((?:    .*\n)*)", page, re.MULTILINE):
        path, options = match.group(1), match.group(2)
        name = path.rsplit(".", 1)[1]
        if path.count(".") > 1 and name in sw.__all__:
            if f'heading: "sw.{name}"' not in options or f'toc_label: "sw.{name}"' not in options:
                untitled.append(path)
    assert untitled == [], f"give these a heading/toc_label of sw.<name> in docs/reference/shardwise.md: {untitled}"

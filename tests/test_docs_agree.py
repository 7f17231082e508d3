"""The pages say the same thing about the same fact (issue 36 point 7)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pages() -> dict[str, str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in pages}


def test_no_page_calls_tensor_parallelism_unsupported():
    """Catches docs/migrate/fsdp.md saying composing with tensor parallelism is not supported while the
    README and docs/slicing.md run zero3 over a 2-D mesh with slicing."""
    said = [name for name, text in _pages().items() if "composing with tensor" in " ".join(text.split())]
    assert said == [], said
    assert "2-D mesh" in _pages()["README.md"] and "2-D mesh" in _pages()["docs/slicing.md"]


def test_the_readme_says_the_suite_runs_on_cpu_only():
    """Catches "the NCCL path exists but the suite runs on CPU only" said on the migration pages alone."""
    text = " ".join(_pages()["README.md"].split())
    assert "the test suite runs on CPU with gloo only" in text


def test_the_demo_says_what_its_losses_depend_on(capsys):
    """Catches the README promising "the same losses" on a re-run while the demo's text is this Python's
    standard library: the README says the losses depend on the Python version, and the demo's table
    names the version it read."""
    from shardwise import demo

    assert "depend on the Python version" in " ".join(_pages()["README.md"].split())
    row = {"strategy": "ddp", "params": 10, "losses": [1.0, 0.5], "model_state_mib": [1.0], "peak_rss_mib": [2.0],
           "median_step_s": 0.1}
    demo.print_summary([row], 2)
    assert f"Python {sys.version_info.major}.{sys.version_info.minor} standard library" in capsys.readouterr().out


def test_results_are_named_by_what_they_measure_and_listed_in_the_bench_readme():
    """Catches a results file named by its issue, commit, round count or host (strategies_issue21_ws2_bdad9d0.md,
    whole_tensor_prev_host.md) instead of by what it measures, or one bench/README.md does not place in its
    question table (one current file per question; older runs are in git history). That every results file a page
    names exists: tests/test_bench_layout.py."""
    readme = (ROOT / "bench" / "README.md").read_text()
    table = readme.split("## Which file answers which question")[1].split("\n## ")[0]
    results = sorted((ROOT / "bench").glob("*/results/*"))
    assert len(results) > 50, "the results moved: bench/FOLDER/results/ is where each bench writes"
    for path in results:
        assert not re.search(r"issue\d|_[0-9a-f]{7,}(_|$)|_r\d+(_|$)|prev|host", path.stem), path.name
        named = f"`{path.parent.parent.name}/results/{path.stem}.md`"
        assert named in table, f"{path.name}: no row of bench/README.md's table names it as {named}"


def test_no_page_refuses_what_works():
    """Catches examples/accelerate_lm.py, examples/README.md and docs/migrate/accelerate.md saying
    `accelerator.save_state` is refused on a sharded model (it writes a shardwise checkpoint, bitwise),
    and the Lightning pages saying "one optimizer per module" (Muon + AdamW under manual optimization
    are saved and loaded together: tests/test_lightning.py)."""
    texts = {**_pages(), **{str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "examples").iterdir())
                            if p.suffix in (".py", ".md")}}
    wrong = ("save_state` is refused", "save_state: refused", "not save_state",
             "save_state` / `load_state` are refused", "one optimizer per")
    said = [(name, phrase) for name, text in texts.items() for phrase in wrong
            if phrase in " ".join(text.split()).lower().replace("accelerator.", "")]
    assert said == [], said


def test_the_readme_is_a_front_page():
    """Catches the README growing back into a copy of docs/ (1,013 lines repeating checkpoints, restarts,
    precision, the planner, speed tables: issue 44 item 15), its tree calling parallel/ "Hogwild" only,
    a docs page the capabilities table does not link, and engine/ internals described there (the engine's
    files move: docs/index.md's "Reading the code" names them)."""
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, len(readme.splitlines())
    tree = next(line for line in readme.splitlines() if line.strip().startswith("parallel/"))
    assert "slicing" in tree and "Hogwild" in tree, tree
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", readme))
    assert pages <= linked, sorted(pages - linked)
    assert not re.search(r"engine/\w+\.py", readme), re.findall(r"engine/\w+\.py", readme)

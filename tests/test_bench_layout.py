"""bench/ in folders by the question each answers (issue 57 point 2): every bench file or results file a page, a
docstring or a results header names exists where it says, bench/README.md's map names real files, and no folder
of bench/ holds more than 12 files. In-process: reading files only."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
MAX_FILES = 12

# A path under bench/ as the pages quote it (bench/speed/strategies.py, bench/comm/results/traffic.{md,png}), one
# {a,b} group possibly. Preceded by "COMMIT:" it is an older run read from git history (`git show
# 16009dd:bench/results/...`), not a file of this tree.
_BENCH_PATH = re.compile(r"(?<![0-9a-f]:)(?<![\w.-])bench/([\w./{},-]*[\w}])")
# NAME, STEM, FOLDER, SCRIPT, COMMIT: a placeholder in a path, not a file.
_PLACEHOLDER = re.compile(r"(?<![a-z])(?!README)[A-Z]{3,}")



def _expand(name: str) -> list[str]:
    """`strategies.{md,png}` -> strategies.md, strategies.png (one brace group at a time)."""
    match = re.search(r"\{([^{}]*)\}", name)
    if match is None:
        return [name]
    return [n for alt in match.group(1).split(",") for n in _expand(name[:match.start()] + alt + name[match.end():])]


def _sources() -> list[Path]:
    """Every file that quotes bench paths: the pages, the results headers, the benches, the tests, the library."""
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml", *(ROOT / "docs").rglob("*.md"),
             *BENCH.rglob("*.md"), *BENCH.rglob("*.py"), *BENCH.rglob("*.sh"), *(ROOT / "tests").rglob("*.py"),
             *(ROOT / "examples").rglob("*.py"), *(ROOT / "examples").rglob("*.md"), *(ROOT / "src").rglob("*.py")]
    return [f for f in files if f.is_file() and f != Path(__file__).resolve()]


def stale_quotes(sources: list[Path]) -> dict[str, set[str]]:
    """{file: the bench paths it names that do not exist}, placeholders and git-history reads left out."""
    stale: dict[str, set[str]] = {}
    for source in sources:
        for raw in _BENCH_PATH.findall(source.read_text(errors="replace")):
            for name in _expand(raw):
                if not (BENCH / name).exists() and not _PLACEHOLDER.search(name):
                    where = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
                    stale.setdefault(str(where), set()).add(name)
    return stale


def test_every_bench_path_a_page_names_exists():
    """Catches a bench or a results file moved or renamed (a folder by question, a result renamed for what it
    measures) while README.md, docs/, bench/README.md, a results header, a bench's docstring, the Makefile or a
    test still names its old path; a placeholder (bench/FOLDER/SCRIPT.py) and a read from git history
    (`git show COMMIT:bench/results/...`) are not files."""
    stale = stale_quotes(_sources())
    assert "README.md" not in stale and (BENCH / "speed" / "strategies.py").is_file()
    assert {f: sorted(names) for f, names in stale.items() if names} == {}


def test_the_checker_finds_a_stale_quote(tmp_path):
    """Catches a pattern that can no longer fail: an old flat path, a brace group with one missing member and a
    missing results file are found; a placeholder and a git-history read are not."""
    page = tmp_path / "page.md"
    page.write_text("`python bench/strategies.py` and bench/speed/strategies.py; bench/comm/results/traffic.{md,txt};"
                    " bench/speed/results/nothing.md; bench/FOLDER/SCRIPT.py; `git show 16009dd:bench/results/x.md`")
    found = stale_quotes([page])
    assert list(found.values()) == [{"strategies.py", "comm/results/traffic.txt", "speed/results/nothing.md"}]


def test_the_bench_readme_maps_real_files():
    """Catches bench/README.md's map (folder -> its benches) or a backticked FOLDER/FILE in it naming a file that
    is not there, and a question folder the map leaves out."""
    readme = (BENCH / "README.md").read_text()
    folders = {p.name for p in BENCH.iterdir() if p.is_dir() and p.name != "__pycache__"}
    mapped, missing = set(), []
    for row in re.findall(r"^\| `(\w+)/` \|(.*)$", readme, re.M):
        folder, rest = row
        mapped.add(folder)
        benches = rest.rsplit("|", 2)[-2]
        named = re.findall(r"`([\w.]+\.py)`", benches)
        missing += [f"{folder}/{n}" for n in named if not (BENCH / folder / n).is_file()]
    for path in re.findall(r"`((?:%s)/[\w./{},-]*\w)" % "|".join(sorted(folders)), readme):
        missing += [name for name in _expand(path) if not (BENCH / name).exists()]
    assert missing == [] and mapped == folders, (missing, sorted(folders - mapped))


def test_no_folder_of_bench_holds_more_than_12_files():
    """Catches bench/ growing back into one room (44 files in one folder before issue 57, 76 in results/): a
    reader finds "how fast", "how big", "is it right" by the folder names, never by reading a file list."""
    crowded = {}
    for folder, dirs, files in os.walk(BENCH):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        counted = [f for f in files if not f.endswith((".pyc", ".tmp"))]
        if len(counted) > MAX_FILES:
            crowded[str(Path(folder).relative_to(ROOT))] = len(counted)
    assert crowded == {}


def test_gpu_check_stays_at_the_top_of_bench():
    """Catches the move of the script the project's instructions name by path ("run bench/gpu_check.sh there
    first") and of the checks it runs."""
    assert (BENCH / "gpu_check.sh").is_file() and (BENCH / "gpu_check.py").is_file()
    assert "bench/gpu_check.py" in (BENCH / "gpu_check.sh").read_text()

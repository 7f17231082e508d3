"""Deliberate mutations of the engine, and the test that must catch each (issue 10's table).

    python bench/correctness/mutations.py            # every mutation: copy src/, apply it, run its tests
    python bench/correctness/mutations.py --jobs 2   # two at a time (each in its own copy of src/)

Each mutation is (name, function, text, replacement, tests to run). The function is named by
its qualified name (`FlatUnit.needs_gather`, `StepDriver.pre_forward`, `any_rank`)
and found wherever it lives under src/shardwise, and the text must occur exactly once in it: a
refactor that moves code between files keeps every mutation; one that rewrites the marked line
says which mutation and function to update. A mutation no test catches is a missing test.
The table is bench/correctness/mutation_table.py. Writes bench/correctness/results/mutations.md.
"""

from __future__ import annotations

import ast
import concurrent.futures
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
from bench.correctness.mutation_table import MUTATIONS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def locate(package: Path, function: str, old: str) -> tuple[Path, int, int] | str:
    """(file, start, end) of the one place `old` occurs in `function` (a qualified name; property
    getter and setter count as one), or why it cannot be mutated."""
    places = []
    for path, start, end in _function_spans(package).get(function, []):
        text = path.read_text()
        found = text.find(old, start, end)
        while found != -1:
            places.append((path, found, found + len(old)))
            found = text.find(old, found + 1, end)
    if len(places) != 1:
        return f"text found {len(places)} times in {function}"
    return places[0]


@functools.cache
def _function_spans(package: Path) -> dict[str, list[tuple[Path, int, int]]]:
    """Every function under `package` by qualified name: (file, start offset, end offset)."""
    spans: dict[str, list[tuple[Path, int, int]]] = {}
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        offsets = [0]
        for line in text.splitlines(keepends=True):
            offsets.append(offsets[-1] + len(line))
        for qualname, node in _functions(ast.parse(text)):
            spans.setdefault(qualname, []).append((path, offsets[node.lineno - 1], offsets[node.end_lineno]))
    return spans


def _functions(tree: ast.AST, prefix: str = ""):
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qualname = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield qualname, child
            yield from _functions(child, qualname + ".")


def run(mutation) -> tuple[str, str, float]:
    name, function, old, new, tests = mutation
    with tempfile.TemporaryDirectory() as scratch:
        src = Path(scratch) / "src"
        shutil.copytree(ROOT / "src", src)
        place = locate(src / "shardwise", function, old)
        if isinstance(place, str):
            return name, place, 0.0
        path, start, end = place
        text = path.read_text()
        path.write_text(text[:start] + new + text[end:])
        # the mutated copy first; the caller's PYTHONPATH after it (an extra's packages kept outside the venv)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")])))
        started = time.time()
        done = subprocess.run(f"{sys.executable} -m pytest -q -x -p no:cacheprovider {tests}", shell=True,
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        # pytest's 5: the selector collected no test, which would have read as caught
        verdict = {0: "NOT CAUGHT", 5: "NO TEST SELECTED"}.get(done.returncode, "caught")
        return name, verdict, time.time() - started


def main() -> None:
    args = sys.argv[1:]
    jobs = 1
    if "--jobs" in args:  # each mutation runs in its own copy of src/, so several can run at once
        at = args.index("--jobs")
        jobs, args = int(args[at + 1]), args[:at] + args[at + 2:]
    wanted = args  # optional: substrings of the mutations to run
    chosen = [m for m in MUTATIONS if not wanted or any(w in m[0] for w in wanted)]
    rows = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for mutation, (name, verdict, seconds) in zip(chosen, pool.map(run, chosen)):  # table order
            rows.append(f"| {name} | `{mutation[1]}` | `{mutation[4]}` | {verdict} ({seconds:.0f} s) |")
            print(rows[-1], flush=True)
    if not wanted:  # the whole table only
        table = "| mutation | function | tests run | result |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
        (Path(__file__).resolve().parent / "results" / "mutations.md").write_text(table)


if __name__ == "__main__":
    main()

"""The Python blocks of README.md and docs/: parsed into sessions, run, and their output compared.

A page's ```` ```python ```` block runs as it is written. An HTML comment right above it (invisible on
the rendered page and on GitHub) may say how:

    <!-- doctest: torchrun=2 continue skip=why
    setup code: the reader's own objects the block names but does not build (a dataset, a model)
    -->

- `torchrun=N`: the block starts a session run by N ranks under torchrun (else: one process);
- `one-process-too`: a torchrun session that the page also says runs as `python train.py`: it runs
  both ways (the one-process run is not held to the output shown, which is the ranks');
- `alone`: the session gets a launch of its own (else it shares one with the sessions of its
  world size: a second Lightning `fit` in the same ranks hangs);
- `continue`: the block runs in the previous block's session, after it, in the same namespace;
- `skip=why`: not run, for a block that cannot run by its nature (the rest of the line says why);
- `slow=why`: run by `make test-all` only, in a launch of its own, for a session whose API another test of
  `make test` runs the same way (the rest of the line names it): a launch is seconds of CPU on 2 cores;
- the comment's other lines are setup, run before the block in its namespace and never shown.

A fence with no language (or `text`) right after a block is the output the block prints (rank
0's, under torchrun). `...` alone on a line stands for any lines, `...` inside a line for any text;
numbers match within 1% (losses differ in their last digits between CPUs).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- doctest:(?P<body>.*?)-->\s*\Z", re.DOTALL)
FENCE = re.compile(r"^```(\w*)\s*$")
NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?")


@dataclass
class Block:
    """One ```python block: where it is, its code, how it runs, and the output it shows."""

    page: str
    line: int
    code: str
    setup: str = ""
    torchrun: int = 0
    alone: bool = False
    continues: bool = False
    skip: str = ""
    slow: str = ""
    expected: str | None = None
    one_process_too: bool = False
    variant: str = ""  # " as python": the one-process run of a `one-process-too` block

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}{self.variant}"


@dataclass
class Session:
    """Blocks that run one after another in one namespace: one process, or `torchrun` ranks."""

    blocks: list[Block] = field(default_factory=list)

    @property
    def torchrun(self) -> int:
        return self.blocks[0].torchrun

    @property
    def name(self) -> str:
        return self.blocks[0].name

    @property
    def launch(self) -> tuple[int, str]:
        """Sessions with the same launch run one after another in one process (or one torchrun)."""
        return self.torchrun, self.name if self.blocks[0].alone or self.slow else ""

    @property
    def slow(self) -> str:
        return self.blocks[0].slow

    @property
    def key(self) -> str:
        """Equal for a block repeated word for word on two pages (README and docs/): run once."""
        text = "\0".join(f"{b.setup}\0{b.code}\0{b.expected}\0{b.torchrun}" for b in self.blocks)
        return hashlib.sha1(text.encode()).hexdigest()


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse(path: Path) -> list[Block]:
    """Every ```python block of one Markdown page, with its marker and the output shown after it."""
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while not lines[end].startswith("```"):
            end += 1
        if fence.group(1) == "python":
            block = Block(page, i + 1, "\n".join(lines[i + 1 : end]) + "\n")
            apply_marker(block, "\n".join(lines[:i]))
            after = FENCE.match(lines[end + 1]) if end + 1 < len(lines) else None
            if after and after.group(1) in ("", "text"):
                close = end + 2
                while not lines[close].startswith("```"):
                    close += 1
                block.expected = "\n".join(lines[end + 2 : close])
                end = close
            blocks.append(block)
        i = end + 1
    return blocks


def apply_marker(block: Block, before: str) -> None:
    marker = MARKER.match(before[before.rfind("<!-- doctest:"):]) if "<!-- doctest:" in before else None
    if marker is None:
        return
    first, _, setup = marker.group("body").partition("\n")
    block.setup = setup
    for word in first.split():
        if word == "continue":
            block.continues = True
        elif word == "alone":
            block.alone = True
        elif word == "one-process-too":
            block.one_process_too = True
        elif word.startswith("torchrun="):
            block.torchrun = int(word.split("=", 1)[1])
        elif word.startswith("skip="):
            block.skip = first.split("skip=", 1)[1].strip()
            break
        elif word.startswith("slow="):
            block.slow = first.split("slow=", 1)[1].strip()
            break
        else:
            raise ValueError(f"{block.name}: unknown doctest option {word!r}")


def sessions() -> list[Session]:
    """Every page's blocks as sessions (skipped blocks left out), each distinct session once."""
    unique: dict[str, Session] = {}
    for path in pages():
        page: list[Session] = []
        for block in parse(path):
            if block.skip:
                continue
            if block.continues and page:
                page[-1].blocks.append(block)
            else:
                page.append(Session([block]))
        for session in page:
            unique.setdefault(session.key, session)
            if session.blocks[0].one_process_too:  # the same code as `python train.py`
                alone = Session([replace(b, torchrun=0, expected=None, variant=" as python") for b in session.blocks])
                unique.setdefault(alone.key, alone)
    return list(unique.values())


def skipped() -> list[Block]:
    return [block for path in pages() for block in parse(path) if block.skip]


def output_matches(expected: str, actual: str) -> bool:
    """`actual` as `expected` shows it: `...` lines for any lines, `...` in a line for any text,
    numbers within 1% (plus 1e-3 for rounding in the last digit shown)."""
    want = [line.rstrip() for line in expected.strip("\n").splitlines()]
    got = [line.rstrip() for line in actual.strip("\n").splitlines()]
    return lines_match(want, got)


def lines_match(want: list[str], got: list[str]) -> bool:
    if not want:
        return not got
    if want[0].strip() == "...":
        return any(lines_match(want[1:], got[k:]) for k in range(len(got) + 1))
    return bool(got) and line_matches(want[0], got[0]) and lines_match(want[1:], got[1:])


def line_matches(want: str, got: str) -> bool:
    """One line: literal text equal, `...` any text, each number within `close` of the one shown."""
    pattern, numbers = [], []
    for part in re.split(r"(\.\.\.|" + NUMBER.pattern + ")", want):
        if part == "...":
            pattern.append(".*?")
        elif part and NUMBER.fullmatch(part):
            pattern.append("(" + NUMBER.pattern + ")")
            numbers.append(part)
        elif part:
            pattern.append(re.escape(part))
    match = re.fullmatch("".join(pattern), got)
    return match is not None and all(
        close(float(a.replace(",", "")), float(b.replace(",", ""))) for a, b in zip(numbers, match.groups()))


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-2, abs_tol=1e-3)

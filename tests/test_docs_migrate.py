"""The migration pages and the README agree with the code (issue 60 item 13): no "Not supported" line
names a feature the docs show working, every `sw.shard` option has a row in some migration page's table,
and the README says where its commands come from."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import shardwise as sw

ROOT = Path(__file__).resolve().parents[1]
MIGRATE = ROOT / "docs" / "migrate"

# What other frameworks call a feature shardwise has, keyed by the option that gives it: a "Not supported"
# line that names one of these while the option exists in the code and the docs show it is out of date.
# An option of sw.shard or a PipelineConfig field is found in the code itself (test below), so a key that
# stops existing fails here rather than silently guarding nothing.
OTHER_NAMES = {
    "compression": ["zero++", "qwz", "qgz", "quantized weights", "quantized gradients", "zero_quantized"],
    "reshard_after_forward": ["hpz", "hierarchical partitioning", "zero_hpz_partition_size"],
    "PipelineConfig.strategy": ["pipeline parallelism combined with zero", "pipeline parallelism combined with "
                                "sharding", "does not compose with `sw.shard`", "keeps full parameters on every rank"],
}


def _flat(text: str) -> str:
    return " ".join(text.split())


def _not_supported_lines(text: str) -> list[str]:
    """The bullets of a page's "Not supported" sections, each on one line."""
    lines = []
    for section in re.split(r"\n## ", text)[1:]:
        title, _, body = section.partition("\n")
        if "not supported" in title.lower():
            lines += [_flat(item) for item in re.split(r"\n- ", "\n" + body) if item.strip()]
    return lines


def _outside_not_supported(text: str) -> str:
    """A page with its "Not supported" sections cut out."""
    sections = re.split(r"\n## ", text)
    return "\n".join(s for s in sections if "not supported" not in s.partition("\n")[0].lower())


def _options_in_code() -> set[str]:
    from shardwise.pipeline import PipelineConfig

    fields = {f"PipelineConfig.{name}" for name in PipelineConfig.__dataclass_fields__}
    return {name for name in inspect.signature(sw.shard).parameters if name != "model"} | fields


def test_no_not_supported_line_names_what_the_docs_show_working():
    """Catches docs/migrate/deepspeed.md listing ZeRO++ (sw.Compression, hpZ) and pipeline x ZeRO
    (PipelineConfig(strategy=...)) as "not supported" while docs/several-machines.md and docs/pipeline.md
    document and run both."""
    assert set(OTHER_NAMES) <= _options_in_code(), set(OTHER_NAMES) - _options_in_code()
    pages = {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))}
    shown = _flat(" ".join(_outside_not_supported(text) for text in pages.values()))
    wrong = []
    for option, names in OTHER_NAMES.items():
        spelled = "strategy=" if option.startswith("PipelineConfig.") else f"{option}="
        assert spelled in shown, f"the docs no longer show {option}: drop it from OTHER_NAMES"
        for page, text in pages.items():
            for line in _not_supported_lines(text):
                wrong += [(page, option, name, line[:80]) for name in names if name in line.lower()]
    assert wrong == [], wrong


def test_every_shard_option_has_a_row_in_a_migration_table():
    """Catches an option of sw.shard that no migration page maps from another framework (docs/migrate/fsdp.md
    never mentioned reshard_after_forward=N, no page compression=): each keyword must appear as `name=` in the
    shardwise column (the last) of some table row of docs/migrate/."""
    columns = []
    for page in sorted(MIGRATE.glob("*.md")):
        for line in page.read_text().splitlines():
            if line.startswith("|") and not line.startswith("|---"):
                columns.append(line.strip().strip("|").split("|")[-1])
    options = [name for name in inspect.signature(sw.shard).parameters if name != "model"]
    missing = [name for name in options if not any(f"{name}=" in column for column in columns)]
    assert missing == [], f"sw.shard options with no row in docs/migrate/*.md tables: {missing}"


def test_the_readme_says_where_its_commands_come_from_and_tables_its_ratios():
    """Catches the README's commands assuming .venv/bin on PATH without saying so, and its "Measured" section
    as a paragraph of ratios (nine runs' zero1 / zero2 / zero3 in one sentence) where a table reads better:
    no prose line there holds more than two ratios."""
    readme = (ROOT / "README.md").read_text()
    assert ". .venv/bin/activate" in readme and ".venv/bin/python" in readme
    measured = readme.split("\n## Measured\n")[1].split("\n## ")[0]
    prose = [line for line in measured.splitlines() if not line.startswith("|")]
    crowded = [line for line in prose if len(re.findall(r"\b[01]\.\d\d\b", line)) > 2]
    assert crowded == [], crowded

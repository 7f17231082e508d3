"""`LoadReport`: what `sw.load` matched, missed and refused, and the matching that fills it."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from shardwise.checkpoint.read.sources import Source, SourceTensor


@dataclass
class LoadReport:
    """What `sw.load` did. Names are the model's, cleaned of wrapper prefixes.

    `missing`: model tensors the source has no value for (they kept their values).
    `unexpected`: source tensors nothing in the model took. `mismatched`: (name, source
    shape, model shape) pairs, not loaded. `closest`: for each missing or unexpected name that
    `print(report)` shows (the first 12 of each), the most similar name on the other side (compared
    with a bound: the first 500 candidates, 128 characters of each name). `problems`: anything else strict loading
    refuses (no optimizer state, different param groups, ...). `notes`: information only.
    `extra`: the JSON values passed to `sw.save(..., **extra)`. `print(report)` shows it all.
    """

    source: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    closest: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    rng_restored: bool = False

    @property
    def ok(self) -> bool:
        """True when everything matched: what strict=True requires."""
        return not (self.missing or self.unexpected or self.mismatched or self.problems)

    def __str__(self) -> str:
        lines = [f"loaded {len(self.loaded)} tensors from {self.source}"]

        def names(title, items):
            if items:
                lines.append(f"{title} ({len(items)}):")
                for name in items[:_SHOWN]:
                    near = self.closest.get(name)
                    lines.append(f"  {name}" + (f"   (closest: {near})" if near else ""))
                if len(items) > _SHOWN:
                    lines.append(f"  ... and {len(items) - _SHOWN} more")

        names("missing from the checkpoint, kept their current values", self.missing)
        names("unexpected in the checkpoint, not loaded", self.unexpected)
        if self.mismatched:
            lines.append(f"shape mismatch, not loaded ({len(self.mismatched)}):")
            lines += [f"  {name}: checkpoint {list(a)}, model {list(b)}" for name, a, b in self.mismatched[:_SHOWN]]
            if len(self.mismatched) > _SHOWN:
                lines.append(f"  ... and {len(self.mismatched) - _SHOWN} more")
        lines += [f"problem: {p}" for p in self.problems]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


_SHOWN = 12  # names listed per kind in str(report); the lists themselves hold all
_CANDIDATES = 500  # names a suggestion is picked from
_COMPARED_CHARS = 128  # of each name, for suggestions
_PREFIX_PARTS = 16  # dotted parts of a name a prefix hint looks at


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str | None:
    """A rename that would explain most missing names: the checkpoint's names with a prefix
    added (a model wrapped in a new parent) or removed (the checkpoint's parent dropped)."""
    counts: dict[tuple[str, str], int] = {}
    for kind, longer, shorter in (("add", missing, set(unexpected)), ("drop", unexpected, set(missing))):
        for name in longer:
            parts = name.split(".")[:_PREFIX_PARTS]
            for i in range(1, len(parts)):
                if ".".join(parts[i:]) in shorter:
                    key = (kind, ".".join(parts[:i]) + ".")
                    counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None
    (kind, prefix), count = max(counts.items(), key=lambda item: item[1])
    if count < max(2, len(missing) // 2):
        return None
    escaped = prefix.replace(".", r"\.")
    if kind == "add":
        return (f"{count} missing names are checkpoint names with {prefix!r} in front: "
                f"rename=[(r'^', {prefix!r})] maps them")
    return (f"{count} missing names are checkpoint names without their {prefix!r} prefix: "
            f"rename=[(r'^{escaped}', '')] maps them")


def match(source: Source, targets: dict[str, tuple[tuple[int, ...], list[str]]], report: LoadReport):
    """Pair each target (name -> (shape, every name it goes by)) with a source tensor; fill the
    report's missing / unexpected / mismatched / closest. Returns {target name: SourceTensor}."""
    lookup: dict[str, SourceTensor] = {}
    for tensor in source.tensors.values():
        for name in (tensor.name, *tensor.aliases):
            lookup.setdefault(name, tensor)
    pairs, used, absent = {}, set(), []
    for target, (shape, names) in targets.items():
        found = [lookup[n] for n in names if n in lookup]
        if not found:
            (absent if source.may_be_absent(target) else report.missing).append(target)
            continue
        used.update(t.name for t in found)
        if len({t.name for t in found}) > 1:
            report.notes.append(f"{target} is tied in the model to {[n for n in names if n != target]} but the "
                                f"checkpoint holds them separately: loaded {found[0].name}, ignored the rest")
        tensor = found[0]
        if tuple(tensor.shape) != tuple(shape):
            report.mismatched.append((target, tuple(tensor.shape), tuple(shape)))
            continue
        pairs[target] = tensor
    report.unexpected.extend(t.name for t in source.tensors.values() if t.name not in used)
    if absent:
        report.notes.append(f"{len(absent)} tensors the model's class lets be absent (_keys_to_ignore_on_load_missing)"
                            f" are not in the checkpoint and kept their values ({', '.join(absent[:4])}"
                            f"{', ...' if len(absent) > 4 else ''})")
    # Suggestions pair what is left on both sides: a missing name is most likely one of
    # the unexpected ones under another name (a rename, a new wrapper, a typo). Bounded: difflib
    # costs the product of the lengths, and a hostile source may hold many long names.
    for names, others in ((report.missing, report.unexpected), (report.unexpected, report.missing)):
        candidates = {other[:_COMPARED_CHARS]: other for other in others[:_CANDIDATES]}
        for name in names[:_SHOWN]:
            near = difflib.get_close_matches(name[:_COMPARED_CHARS], list(candidates), n=1, cutoff=0.5)
            if near:
                report.closest[name] = candidates[near[0]]
    hint = _prefix_hint(report.missing[:_CANDIDATES], report.unexpected[:_CANDIDATES])
    if hint:
        report.notes.append(hint)
    return pairs

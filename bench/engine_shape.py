"""The engine's shape in numbers: files, lines, the largest classes (lines, methods, attributes)
and functions, and who uses whom (each module's "Uses:" line), for issue 21's before/after.

    python bench/engine_shape.py                 # this checkout's src/
    git archive 41f436b src | tar -x -C /tmp/old && python bench/engine_shape.py /tmp/old/src
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def shape(src: Path) -> None:
    engine = src / "shardwise" / "engine"
    files = sorted(engine.glob("*.py"))
    classes, functions = [], []
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                attributes = {target.attr for n in ast.walk(node) for target in _targets(n)
                              if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                              and target.value.id == "self"}
                classes.append((node.end_lineno - node.lineno + 1, len(methods), len(attributes),
                                f"{path.stem}.{node.name}"))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{path.stem}.{node.name}"))
    lines = {path.stem: len(path.read_text().splitlines()) for path in files}
    print(f"engine: {len(files)} files, {sum(lines.values())} lines; largest: "
          + ", ".join(f"{name} {n}" for n, name in sorted(((n, f) for f, n in lines.items()), reverse=True)[:4]))
    print("largest classes (lines, methods, attributes):")
    for size, methods, attributes, name in sorted(classes, reverse=True)[:6]:
        print(f"  {name}: {size}, {methods}, {attributes}")
    print("largest functions (lines): " + ", ".join(f"{name} {n}" for n, name in sorted(functions, reverse=True)[:4]))
    print("uses:")
    for path in files:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if "Uses: " in doc:
            print(f"  {path.stem}: " + " ".join(doc.split("Uses: ", 1)[1].split(".", 1)[0].split()))


def _targets(node: ast.AST) -> list:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


if __name__ == "__main__":
    shape(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src")

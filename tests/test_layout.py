"""The package's layout is its architecture: layers point down, no import cycles, small modules.

Parses every module under src/ with `ast` (imports inside functions count too) and checks
the layer table below, which docs/index.md's "Reading the code" follows.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Lower layers never import higher ones; within one group (a subpackage) anything goes
# except a cycle. Every module of the package must fall in some group.
LAYERS = {
    "shardwise._version": 0,
    "shardwise.errors": 0,
    "shardwise.allocator": 0,  # glibc's settings, set by sw.init (Note [allocator at init])
    "shardwise.teardown": 0,  # what closes at exit (Note [exit teardown]): everything below may register
    "shardwise.wire.canonical": 0,  # options in a canonical form: config.py marks its per-rank fields with it
    "shardwise.wire.backends": 0,  # which backend serves which device (Note [group backends]): dist, wire, the engine
    "shardwise.config": 1,
    "shardwise.dist": 1,
    "shardwise.collective_watch": 1,  # watches torch.distributed's collectives: every traffic counter
    "shardwise.interfaces": 1,
    "shardwise.wire": 1,  # safetensors headers and rank messages: the engine, checkpoint/ and pipeline/ use them
    "shardwise.models": 1,  # models hold only the math
    "shardwise.sampler": 2,
    "shardwise.engine": 2,
    "shardwise.checkpoint": 3,
    "shardwise.parallel": 3,  # hogwild (the host copy is the engine's: shard() applies it)
    "shardwise.testing": 4,
    "shardwise.pipeline": 4,  # stages sharded by the engine, saved through checkpoint/ (pipeline/checkpoint/)
    "shardwise.integrations": 4,  # trainers people already use: above the library, beside testing
    "shardwise.estimate": 5,  # the estimator and planner weigh pipe layouts too (estimate/pipe.py uses pipeline/)
    "shardwise": 6,  # the public API: __init__.py
    "shardwise.demo": 7,
    "shardwise.cli": 8,
}
MAX_LINES = 400


def module_files(root: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module under `root`."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports (the most specific known module of each import)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg.
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                          for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def group_of(module: str) -> str:
    matches = [g for g in LAYERS if module == g or module.startswith(g + ".")]
    return max(matches, key=len)


def layout_problems(root: Path = SRC) -> list[str]:
    """Every violation of the layout rules in the tree under `root`, as sentences."""
    files = module_files(root)
    graph = {name: imports_of(name, path, set(files)) for name, path in files.items()}
    problems = []
    for name, targets in graph.items():
        for target in sorted(targets):
            mine, theirs = group_of(name), group_of(target)
            if mine != theirs and LAYERS[theirs] >= LAYERS[mine]:
                problems.append(f"{name} (layer {LAYERS[mine]}) imports {target} (layer {LAYERS[theirs]}): "
                                "layers point down only")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in find_cycles(graph)]
    for name, path in files.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            problems.append(f"{name}: {lines} lines (at most {MAX_LINES}: split it by idea)")
    return problems


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected part of `graph` with more than one module."""
    cycles, done = [], set()
    for start in sorted(graph):
        path, on_path = [], set()

        def visit(node: str) -> list[str] | None:
            if node in on_path:
                return path[path.index(node):] + [node]
            if node in done:
                return None
            path.append(node)
            on_path.add(node)
            for nxt in sorted(graph.get(node, ())):
                found = visit(nxt)
                if found:
                    return found
            path.pop()
            on_path.discard(node)
            done.add(node)
            return None

        cycle = visit(start)
        if cycle:
            cycles.append(cycle)
            done.update(cycle)
    return cycles


def test_every_module_belongs_to_a_layer():
    """Catches a new top-level module nobody placed in the layer table."""
    assert all(group_of(name) for name in module_files())


def test_layers_point_down_with_no_cycles_and_small_modules():
    """Catches an upward import (the engine reaching into checkpoint/, anything importing the CLI),
    an import cycle (lazy imports included) or a module past 400 lines."""
    assert layout_problems() == []


@pytest.mark.parametrize("files, expected", [
    ({"shardwise/__init__.py": "", "shardwise/engine/__init__.py": "",
      "shardwise/engine/zero.py": "def f():\n    from shardwise.checkpoint.write import save\n",
      "shardwise/checkpoint/__init__.py": "save = 1\n"},
     "shardwise.engine.zero (layer 2) imports shardwise.checkpoint (layer 3)"),
    ({"shardwise/__init__.py": "", "shardwise/engine/__init__.py": "",
      "shardwise/engine/a.py": "from shardwise.engine import b\n",
      "shardwise/engine/b.py": "from . import a\n"},
     "import cycle: shardwise.engine.a -> shardwise.engine.b -> shardwise.engine.a"),
    ({"shardwise/__init__.py": "", "shardwise/errors.py": "x = 1\n" * 401}, "shardwise.errors: 401 lines"),
])
def test_the_checker_sees_each_kind_of_problem(tmp_path, files, expected):
    """Catches a checker that cannot fail: each rule is broken once in a scratch tree."""
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    assert any(expected in problem for problem in layout_problems(tmp_path))


# Note [engine protocol] (engine/protocol.py): where a model's engine and slicing are kept.
PRIVATE_ATTRIBUTES = {"_shardwise", "_sw_slicing"}
PROTOCOL_MODULE = "shardwise.engine.protocol"


def probing_problems(root: Path = SRC) -> list[str]:
    """Every place that finds an engine other than through the protocol: a read of the attributes
    it is kept in outside protocol.py, or hasattr/getattr on an engine (guessing which one it is)."""
    problems = []
    for name, path in module_files(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{name}:{getattr(node, 'lineno', '?')}"
            if name != PROTOCOL_MODULE and (
                    isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES
                    or isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRIBUTES):
                problems.append(f"{where} reads a model's engine or slicing directly: use engine_of / slicing_of")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and node.args
                    and isinstance(node.args[0], ast.Name) and "engine" in node.args[0].id):
                problems.append(f"{where} probes an engine with {node.func.id}: ask what engine.Engine declares")
    return problems


def test_the_engine_is_reached_through_its_protocol_only():
    """Catches a caller that probes an engine's attributes (hasattr(engine, "units")) or reads the
    model attribute it is kept in, instead of engine_of(model) and what Engine declares."""
    assert probing_problems() == []


@pytest.mark.parametrize("source", ['e = getattr(model, "_shardwise", None)\n', "s = model._sw_slicing\n",
                                    'ok = hasattr(engine, "units")\n'])
def test_the_protocol_checker_sees_each_probe(tmp_path, source):
    """Catches a protocol checker that cannot fail."""
    (tmp_path / "shardwise" / "checkpoint").mkdir(parents=True)
    (tmp_path / "shardwise" / "__init__.py").write_text("")
    (tmp_path / "shardwise" / "checkpoint" / "__init__.py").write_text(source)
    assert probing_problems(tmp_path)


def engine_uses_problems(root: Path = SRC) -> list[str]:
    """Each engine module says in its docstring which engine modules it uses ("Uses: a, b." or
    "Uses: nothing of the engine."): the list must be exactly what it imports."""
    problems = []
    for name, path in module_files(root).items():
        if not name.startswith("shardwise.engine.") or path.name == "__init__.py":
            continue
        known = module_files(root)
        # Engine modules are named by their file (unique across engine/'s subpackages), not their package.
        imported = {target.rpartition(".")[2] for target in imports_of(name, path, set(known))
                    if target.startswith("shardwise.engine.") and known[target].name != "__init__.py"}
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        said = " ".join(doc.split("Uses: ", 1)[1].split(".", 1)[0].split()) if "Uses: " in doc else None
        if said is None:
            problems.append(f"{name}: no 'Uses: ...' line in its docstring")
            continue
        listed = set() if said == "nothing of the engine" else {part.strip() for part in said.split(",")}
        if listed != imported:
            problems.append(f"{name}: docstring says it uses {sorted(listed)}, it imports {sorted(imported)}")
    return problems


def test_each_engine_file_says_which_others_it_uses():
    """Catches an engine module that starts using another (or stops) without saying so in its first
    lines, where the next reader looks for who calls whom."""
    assert engine_uses_problems() == []


def test_the_uses_checker_sees_a_wrong_list(tmp_path):
    """Catches a uses checker that cannot fail."""
    engine = tmp_path / "shardwise" / "engine"
    engine.mkdir(parents=True)
    (tmp_path / "shardwise" / "__init__.py").write_text("")
    (engine / "__init__.py").write_text("")
    (engine / "a.py").write_text('"""A.\nUses: nothing of the engine.\n"""\nfrom shardwise.engine import b\n')
    (engine / "b.py").write_text('"""B.\nUses: nothing of the engine.\n"""\n')
    assert engine_uses_problems(tmp_path) == [
        "shardwise.engine.a: docstring says it uses [], it imports ['b']"]


# Issue 43: the shape's own rules, counted on the tree (Note [one maker of groups], Note [rows], Note [one step hook]).
GROUP_MAKER = "shardwise.engine.layout.groups"
STAMP_OWNERS = {"shardwise.engine": "_sw_"}  # issue 43: no package outside the engine stamps or reads one
MAX_MODULES_PER_FOLDER = 12


def shape_problems(root: Path = SRC) -> list[str]:
    """A process group made outside the layout's maker, a `_sw_` stamp read outside the package that
    writes it, or a folder of the package with more than 12 modules (its __init__.py not counted)."""
    problems = []
    for name, path in module_files(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and node.attr == "new_group" and name != GROUP_MAKER:
                problems.append(f"{where} makes a process group: ask engine/layout/groups.make_group")
            stamp = node.attr if isinstance(node, ast.Attribute) else node.value if (
                isinstance(node, ast.Constant) and isinstance(node.value, str)) else ""
            if stamp.startswith("_sw_") and not any(
                    name.startswith(owner) and stamp.startswith(prefix) for owner, prefix in STAMP_OWNERS.items()):
                problems.append(f"{where} reads the stamp {stamp}: ask the package that writes it")
    folders: dict[Path, int] = {}
    for path in (root / "shardwise").rglob("*.py"):
        if path.name != "__init__.py":
            folders[path.parent] = folders.get(path.parent, 0) + 1
    problems += [f"{folder}: {count} modules in one folder (at most {MAX_MODULES_PER_FOLDER}: split by concept)"
                 for folder, count in folders.items() if count > MAX_MODULES_PER_FOLDER]
    return problems


def test_groups_stamps_and_folders_keep_their_places():
    """Catches a `dist.new_group` outside the layout (a group made where its timeout and teardown are
    not), a package reading another's `param._sw_*` stamp instead of asking it (checkpoint/ reading
    `_sw_unit`), and any folder growing back into one flat room (issue 57: checkpoint/ was 25 modules)."""
    assert shape_problems() == []


@pytest.mark.parametrize("source", ["import torch.distributed as dist\ng = dist.new_group([0, 1])\n",
                                    "def f(p):\n    return p._sw_unit\n", 'x = getattr(p, "_sw_layout", None)\n'])
def test_the_shape_checker_sees_each_problem(tmp_path, source):
    """Catches a shape checker that cannot fail."""
    (tmp_path / "shardwise" / "checkpoint").mkdir(parents=True)
    (tmp_path / "shardwise" / "engine").mkdir(parents=True)
    (tmp_path / "shardwise" / "__init__.py").write_text("")
    (tmp_path / "shardwise" / "checkpoint" / "__init__.py").write_text(source)
    assert shape_problems(tmp_path)


def test_the_folder_rule_holds_outside_the_engine_too(tmp_path):
    """Catches a folder rule that looks at engine/ alone: a checkpoint/ of 13 flat modules is refused."""
    folder = tmp_path / "shardwise" / "checkpoint"
    folder.mkdir(parents=True)
    (tmp_path / "shardwise" / "__init__.py").write_text("")
    for number in range(13):
        (folder / f"m{number}.py").write_text("")
    assert shape_problems(tmp_path) == [f"{folder}: 13 modules in one folder (at most 12: split by concept)"]


# Issue 57: inside a package, its subpackages stand in an order, lowest first, and a module imports only from its
# own entry or a lower one. An entry names a subpackage or a module directly in the package; a tuple holds peers,
# which may import each other (a cycle is still caught above). Every child of a listed package must be placed, so a
# new one is put somewhere on purpose.
SUBPACKAGE_ORDER = {
    "shardwise.engine": [
        ("compat", "guards", "phase"),  # torch's internals, the copy guard, the engine's clock: nothing of the engine
        "protocol",  # what the layers above may ask of an engine
        "layout",  # ranks, rows, groups
        "comm",  # the collectives
        "memory",  # precision, offload, host copies
        "unit",  # a unit's shards, full views, lifecycle, gradients and stage policy
        "schedule",  # the window, the order of gathers and reduces, the agreement
        "optim",  # the optimizer's side
        "init",  # set-up: a model's units built, deferred init replayed
        ("state_dict", "describe", "ddp"),  # the user-facing views; torch's DDP
        "zero",  # the zero engine: builds all of the above
        "api",  # shard()
    ],
    "shardwise.checkpoint": [
        "format",  # what a checkpoint is on disk, and its checks
        "write",  # a save
        "read",  # a load
        "interop",  # exports, DCP, the offline tools
    ],
}


def _child(package: str, module: str) -> str | None:
    """The entry of `package` (a subpackage or module directly in it) that holds `module`; None for the package."""
    return module[len(package) + 1:].split(".")[0] if module.startswith(package + ".") else None


def order_problems(root: Path = SRC, order: dict[str, list] = SUBPACKAGE_ORDER) -> list[str]:
    """Every import from a lower subpackage to a higher one of a package in `order`, and every child it omits."""
    files = module_files(root)
    problems = []
    for package, entries in order.items():
        rank = {name: i for i, entry in enumerate(entries) for name in ((entry,) if isinstance(entry, str) else entry)}
        children = {_child(package, name) for name in files} - {None}
        problems += [f"{package}.{child}: not in SUBPACKAGE_ORDER (place it among {package}'s subpackages)"
                     for child in sorted(children - set(rank))]
        for name, path in files.items():
            mine = _child(package, name)
            for target in sorted(imports_of(name, path, set(files))):
                theirs = _child(package, target)
                if mine in rank and theirs in rank and rank[theirs] > rank[mine]:
                    problems.append(f"{name} imports {target}: {package}.{mine} sits below {package}.{theirs} "
                                    "(move what it needs down to where it belongs)")
    return problems


def test_subpackages_import_only_lower_ones():
    """Catches an import that runs back up between a package's subpackages (unit/ importing the stage policies
    from schedule/ while schedule/ imports unit/, memory/ asking optim/), and a new subpackage nobody placed."""
    assert order_problems() == []


@pytest.mark.parametrize("files, expected", [
    ({"shardwise/engine/low/a.py": "from shardwise.engine.high import b\n", "shardwise/engine/high/b.py": ""},
     "shardwise.engine.low.a imports shardwise.engine.high.b: shardwise.engine.low sits below shardwise.engine.high"),
    ({"shardwise/engine/low/a.py": "def f():\n    from shardwise.engine.high.b import g\n",
      "shardwise/engine/high/b.py": "g = 1\n"}, "shardwise.engine.low.a imports shardwise.engine.high.b"),
    ({"shardwise/engine/new/a.py": ""}, "shardwise.engine.new: not in SUBPACKAGE_ORDER"),
])
def test_the_order_checker_sees_each_problem(tmp_path, files, expected):
    """Catches an order checker that cannot fail: an import up (at the top and inside a function), a child unplaced."""
    files = {"shardwise/__init__.py": "", "shardwise/engine/__init__.py": "", "shardwise/engine/low/__init__.py": "",
             "shardwise/engine/high/__init__.py": "", **files}
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    problems = order_problems(tmp_path, {"shardwise.engine": ["low", "high"]})
    assert any(expected in problem for problem in problems), problems

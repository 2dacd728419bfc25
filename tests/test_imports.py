"""The package's import graph: no cycles, and the layering the design relies on.

The graph is read from the source (every ``import`` statement, function-level ones
included), because the cycles that hurt hid behind function-level imports: ``asyncrl eval``
once shipped with an ImportError across an evaluate <-> train cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import REPO_ROOT

PACKAGES = ("asyncrl", "workflows")

# The folders by layer (docs/design.md "Module map"), lowest first. A module may import its own
# layer and the layers below it, never one above: the tree reads like the layer table.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("asyncrl", "asyncrl.errors", "asyncrl.imports", "asyncrl.pytree", "asyncrl.registry",
                    "asyncrl.config", "asyncrl.data")),
    ("math and model", ("asyncrl.algo", "asyncrl.model")),
    ("cluster", ("asyncrl.cluster",)),
    ("engines", ("asyncrl.engine",)),
    ("rollout", ("asyncrl.rollout",)),
    ("agents", ("asyncrl.agent",)),
    ("trainer", ("asyncrl.trainer",)),
    ("checkpoint", ("asyncrl.checkpoint",)),
    ("plan", ("asyncrl.plan",)),
    ("run", ("asyncrl.run",)),
    ("serve", ("asyncrl.serve",)),
    ("workflows", ("workflows",)),
    ("entry points", ("asyncrl.cli", "asyncrl.__main__")),
)

# module -> modules it must never reach through imports, even below its own layer (the one-way
# data flow of DESIGN): checkpoints store arrays and JSON and do not know the rollout executor;
# the math does not know the moving parts; eval does not know the loop.
FORBIDDEN_REACH = {
    "asyncrl.checkpoint": ("asyncrl.rollout.executor", "asyncrl.run.loop"),
    "asyncrl.algo": ("asyncrl.trainer", "asyncrl.rollout", "asyncrl.engine", "asyncrl.run"),
    "asyncrl.model": ("asyncrl.trainer", "asyncrl.rollout", "asyncrl.engine", "asyncrl.run"),
    "asyncrl.run.evaluate": ("asyncrl.run.loop",),
}


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest prefix that names ``module`` or a package holding it."""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer of LAYERS: add its folder to the table (and to docs/design.md)")
    return best


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``) for every module of PACKAGES."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _imported_names(tree: ast.AST, package: str) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from a.b import c`` imports a.b, and a.b.c when c is a submodule
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def import_graph(root: Path = REPO_ROOT) -> dict[str, set[str]]:
    """module -> the package modules it imports by name (implicit parent packages left out:
    a package ``__init__`` that re-exports its submodules is not a cycle)."""
    modules = _modules(root)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        targets = {owner(t) for t in _imported_names(ast.parse(path.read_text(), str(path)), package)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _describe(graph: dict[str, set[str]], component: list[str]) -> str:
    inside = set(component)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & inside))}" for m in component)


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles (function-level imports count): " + " | ".join(_describe(graph, c) for c in found)


def test_every_import_points_to_its_own_layer_or_below():
    graph = import_graph()
    upward = [f"{source} ({LAYERS[layer_of(source)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
              for source, targets in sorted(graph.items()) for target in sorted(targets)
              if layer_of(target) > layer_of(source)]
    assert not upward, "imports into a higher layer: " + "; ".join(upward)


def test_forbidden_reaches():
    graph = import_graph()
    problems = []
    for source, banned in FORBIDDEN_REACH.items():
        starts = [m for m in graph if m == source or m.startswith(source + ".")]
        for start in starts:
            reach = reachable(graph, start)
            problems += [f"{start} reaches {m}" for m in sorted(reach)
                         if any(m == b or m.startswith(b + ".") for b in banned)]
    assert not problems, "; ".join(problems)


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "asyncrl"
    pkg.mkdir()
    (tmp_path / "workflows").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import asyncrl.b\n")
    (pkg / "b.py").write_text("def f():\n    from asyncrl import a\n    return a\n")
    (pkg / "c.py").write_text("from . import b\n")
    graph = import_graph(tmp_path)
    assert graph["asyncrl.c"] == {"asyncrl", "asyncrl.b"}  # ``from . import b`` runs the package too
    assert cycles(graph) == [["asyncrl.a", "asyncrl.b"]]
    assert reachable(graph, "asyncrl.c") == {"asyncrl", "asyncrl.a", "asyncrl.b"}


def test_public_train_is_the_function_whatever_was_imported_first():
    import importlib.util
    import inspect

    import asyncrl.run.loop  # noqa: F401 - imported first on purpose: it once made `asyncrl.train` the module
    from asyncrl import train

    assert inspect.isfunction(train) and train.__module__ == "asyncrl.run.loop"
    assert importlib.util.find_spec("asyncrl.train") is None  # no module shadows the public function


# --------------------------------------------------------------------------- the module map and file sizes


def module_map(text: str) -> dict[str, list[str]]:
    """docs/design.md "Module map": folder (``""`` for the package root) -> the module files its
    table names, in the order of the table's rows (``folder/`` (``a.py``, ...) or a root ``x.py``)."""
    table = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, list[str]] = {}
    for row in (line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| layer")):
        cell = row.split(" | ")[1]
        for folder, inner in re.findall(r"`(\w+)/` \(([^)]*)\)", cell):
            listed[folder] = re.findall(r"`(\w+(?:\.py|/))`", inner)
        root = re.sub(r"`\w+/` \([^)]*\)", "", cell)
        listed.setdefault("", []).extend(re.findall(r"`(\w+\.py)`", root))
    return listed


def test_the_module_map_lists_every_module_in_its_layer():
    """Every module under asyncrl/ (and every folder of data files in a package) appears in
    docs/design.md's module map, nothing else does, and the map's rows go up the layers of LAYERS."""
    listed = module_map((REPO_ROOT / "docs" / "design.md").read_text())
    root = REPO_ROOT / "asyncrl"
    actual: dict[str, set[str]] = {"": {p.name for p in root.glob("*.py") if p.name != "__init__.py"}}
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()):
        actual[folder.name] = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
        actual[folder.name] |= {p.name + "/" for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"}
    problems = []
    for folder in sorted(set(actual) | set(listed)):
        where = f"asyncrl/{folder + '/' if folder else ''}"
        missing, extra = actual.get(folder, set()) - set(listed.get(folder, [])), set(listed.get(folder, [])) - actual.get(folder, set())
        problems += [f"{where}{name} is not in the map" for name in sorted(missing)]
        problems += [f"the map names {where}{name}, which does not exist" for name in sorted(extra)]
    assert not problems, "docs/design.md \"Module map\": " + "; ".join(problems)
    order = [layer_of(f"asyncrl.{folder}") for folder in listed if folder]
    assert order == sorted(order), "the module map's rows are not in the order of LAYERS"


def test_the_module_map_check_sees_a_missing_module():
    text = "## Module map\n\n| layer | modules | what |\n|---|---|---|\n| run | `cli.py`, `run/` (`loop.py`, `build.py`) | x |\n"
    assert module_map(text) == {"run": ["loop.py", "build.py"], "": ["cli.py"]}


LONG_FILE_LINES = 600


def test_a_module_over_600_lines_says_why_it_stays_one_file():
    """A module past LONG_FILE_LINES lines is split by concern, or its docstring says why it stays
    whole (a sentence with "one file" or "stays whole")."""
    unexplained = []
    for path in sorted((REPO_ROOT / "asyncrl").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > LONG_FILE_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if not re.search(r"one file|stays whole", doc):
                unexplained.append(f"{path.relative_to(REPO_ROOT)} ({text.count(chr(10))} lines)")
    assert not unexplained, "split these by concern, or say in the docstring why each stays one file: " + ", ".join(unexplained)


def test_names_are_imported_from_the_module_that_defines_them():
    """No re-export shims: an unused import kept on purpose (``noqa: F401``) is a package's
    ``__init__`` (its public names) or an import for its side effect, never a module passing on
    another's names."""
    shims = []
    for path in sorted([*(REPO_ROOT / "asyncrl").rglob("*.py"), *(REPO_ROOT / "workflows").rglob("*.py")]):
        if path.name == "__init__.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "noqa: F401" in line and "side effect" not in line and "imported first on purpose" not in line:
                shims.append(f"{path.relative_to(REPO_ROOT)}:{number}")
    assert not shims, "re-exported names (import them from their own module): " + ", ".join(shims)

"""The package's import graph: no cycles, and the layering the design relies on.

The graph is read from the source (every ``import`` statement, function-level ones
included), because the cycles that hurt hid behind function-level imports: ``asyncrl eval``
once shipped with an ImportError across an evaluate <-> train cycle.
"""

from __future__ import annotations

import ast
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

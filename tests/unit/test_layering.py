"""The code's layers run one way (docs/architecture.md): no import cycle between modules, the library never
reaches the server side or a benchmark, and front-ends use only the router's public request path.

Imports are read from the source (module-level and function-local ``import``/``from`` and
``importlib.import_module("...")`` with a literal), so a cycle hidden in a function body counts too.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("calid", "serve_app", "actors")
GENERATED = ROOT / "calid" / "v1"
BENCH_FOLDERS = ("calid.bench", "serve_app.bench")
CLI = "serve_app.main"  # the calid command: the top of every layer, it may read the benchmark registry


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if GENERATED in path.parents:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imported(tree: ast.AST, package: str) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names += [base] + [f"{base}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant)):
            names.append(node.args[0].value)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for target in _imported(ast.parse(path.read_text()), package):
            to = owner(target)
            if to and to != name:
                graph[name].add(to)
    for name in modules:
        graph.setdefault(name, set())
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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


def _in(name: str, folder: str) -> bool:
    return name == folder or name.startswith(folder + ".")


def test_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_library_imports_neither_server_nor_ray_side():
    graph = import_graph()
    wrong = sorted((m, t) for m, ts in graph.items() if _in(m, "calid") for t in ts
                   if _in(t, "serve_app") or _in(t, "actors"))
    assert wrong == []


def test_only_benchmarks_and_the_cli_import_a_benchmark():
    graph = import_graph()
    wrong = sorted((m, t) for m, ts in graph.items() for t in ts
                   if any(_in(t, b) for b in BENCH_FOLDERS) and not any(_in(m, b) for b in BENCH_FOLDERS)
                   and m != CLI)
    assert wrong == []


def test_front_ends_use_the_public_request_path():
    """No module but the router itself touches ``router._anything`` (front-ends get a router instance)."""
    wrong = []
    for name, path in _modules().items():
        if name == "serve_app.router.router":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id == "router"):
                wrong.append(f"{name}:{node.lineno} router.{node.attr}")
    assert wrong == []

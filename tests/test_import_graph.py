"""turbo's import graph, read from the source (the AST, nothing imported): no cycle among the
modules' top-level imports, none either when the imports under `if TYPE_CHECKING:` are counted
(a cycle in the types is one in the design), none among the packages (turbo/store, turbo/sequence,
..., each top-level module a unit of its own), at most 15 modules directly under turbo/, and no
turbo module imported inside a function unless it is listed below with the reason it has to wait
(an optional dependency, or startup kept light). An import moved into a function to dodge a
cycle hides the cycle; the shared piece belongs in a module both sides can import (issue 43)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("turbo", "tui")

# (importer, imported): why the import waits for the function that needs it.
LAZY_ALLOWED = {
    ("turbo.__main__", "turbo.engine"): "torch and the engine load once the command line is known good "
                                        "(a refusal stays quick)",
    ("turbo.__main__", "turbo.probe"): "as turbo.engine: only task=probe runs it",
    ("turbo.__main__", "turbo.chat_cli"): "as turbo.engine: only task=chat runs it",
    ("turbo.__main__", "turbo.serve.main"): "the serve extra (fastapi, uvicorn): only task=serve needs it",
    ("turbo.serve.main", "turbo.serve.app"): "fastapi (the serve extra), after run_serve's require() checked it",
    ("turbo.serve.main", "turbo.serve.front"): "httpx and uvicorn (the serve extra), after require() checked them",
    ("turbo.serve.main", "turbo.serve.head"): "uvicorn and httptools (the serve extra), after require() checked them",
    ("turbo.serve.main", "turbo.serve.worker"): "prometheus_client (the serve extra), after require() checked it",
    ("turbo.serve.ray_app", "turbo.serve.app"): "fastapi, in the Ray replica (main.py imports ray_app before "
                                                "require() runs)",
    ("turbo.serve.ray_app", "turbo.serve.worker"): "prometheus_client, in the Ray replica (as turbo.serve.app)",
    ("tui", "tui.app"): "textual (the tui extra): `from tui import TurboApp` names the extra when it is missing",
    ("tui.__main__", "tui.app"): "textual (the tui extra), after require() checked it",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, in_function: bool, out: list[tuple[ast.Import | ast.ImportFrom, bool]],
             types: bool = False) -> None:
    """Every import under `node`, with whether it runs inside a function; the body of an
    `if TYPE_CHECKING:` only with `types` (it never runs, but names what the module depends on)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            out.append((child, in_function))
        elif isinstance(child, ast.If) and _type_checking(child.test):
            for stmt in child.body if types else []:
                _imports(ast.Module(body=[stmt], type_ignores=[]), in_function, out, types)
            for stmt in child.orelse:
                _imports(ast.Module(body=[stmt], type_ignores=[]), in_function, out, types)
        else:
            _imports(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                     out, types)


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The modules of ours an import statement loads."""
    if isinstance(node, ast.Import):
        found = [a.name for a in node.names]
    else:
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        found = [module] + [f"{module}.{a.name}" for a in node.names]
    return [m for m in found if m in known]


def graph(types: bool = False) -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """(module -> the modules its top-level imports run, counting the packages they sit in, and
    with `types` those its TYPE_CHECKING imports name; the function-level imports of our modules
    as (importer, imported, line))."""
    files = sources()
    known = set(files)
    edges: dict[str, set[str]] = {m: set() for m in files}
    lazy = []
    for name, path in files.items():
        found: list = []
        _imports(ast.parse(path.read_text(), str(path)), False, found, types)
        for node, in_function in found:
            for target in _targets(name, path.name == "__init__.py", node, known):
                if in_function:
                    lazy.append((name, target, node.lineno))
                    continue
                # importing a.b.c runs a and a.b first (those the importer sits in already are running)
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    up = ".".join(parts[:i])
                    if up in known and up != name and not name.startswith(up + "."):
                        edges[name].add(up)
    return edges, lazy


def unit(module: str) -> str:
    """The part of the house a module belongs to: its package directly under turbo/ (turbo.sequence),
    the top-level module itself (turbo.engine), or tui."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "turbo" else parts[0]


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph among units (above); turbo/__init__.py imports nothing of ours at its top (its names load lazily)."""
    units: dict[str, set[str]] = {unit(m): set() for m in edges}
    for m, targets in edges.items():
        units[unit(m)] |= {unit(t) for t in targets if t != "turbo" and unit(t) != unit(m)}
    return units


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_as_python_runs_imports():
    """The reader itself: a package's import runs its parents, TYPE_CHECKING imports do not run,
    and the repack package's cycle through open_layout (fixed in 22ba1ca) would be found."""
    edges, lazy = graph()
    assert "turbo.repack.tensors" in edges["turbo.repack.source"]
    assert {"turbo.store.safetensors_format", "turbo.load.reader"} <= edges["turbo.load.open_layout"]
    assert "turbo.engine" not in edges["turbo.chat_cli"]  # (only under TYPE_CHECKING there)
    assert ("turbo.__main__", "turbo.engine") in {(a, b) for a, b, _ in lazy}
    assert cycles({"a": {"b.c"}, "b": {"a"}, "b.c": {"b"}}) == [["a", "b", "b.c"]]
    broken = {m: set(t) for m, t in edges.items()}
    broken["turbo.load.open_layout"].add("turbo.repack")
    assert any({"turbo.repack", "turbo.load.open_layout"} <= set(c) for c in cycles(broken))


def test_no_import_cycle():
    edges, _ = graph()
    found = cycles(edges)
    assert found == [], "import cycles (break each by moving the shared piece, not by a function-level import): " + \
        "; ".join(" <-> ".join(c) for c in found)


def test_function_level_imports_of_ours_are_listed():
    _, lazy = graph()
    unlisted = [f"{a} line {line}: {b}" for a, b, line in lazy if (a, b) not in LAZY_ALLOWED]
    assert unlisted == [], ("imports of turbo / tui modules inside a function, not in LAZY_ALLOWED (import it at "
                            "the top, or move the shared piece out of the cycle): " + "; ".join(unlisted))
    used = {(a, b) for a, b, _ in lazy}
    stale = sorted(set(LAZY_ALLOWED) - used)
    assert stale == [], f"LAZY_ALLOWED entries no module has any more: {stale}"


def test_no_import_cycle_in_the_types_either():
    edges, _ = graph(types=True)
    found = cycles(edges)
    assert found == [], "import cycles counting TYPE_CHECKING imports (name what one side needs by a narrow " + \
        "Protocol on its own side, or move the shared piece): " + "; ".join(" <-> ".join(c) for c in found)


def test_no_cycle_among_packages():
    edges, _ = graph(types=True)
    units = package_graph(edges)
    assert {"turbo.sequence", "turbo.store", "turbo.engine", "tui"} <= set(units)
    assert "turbo.store" in units["turbo.sequence"] and "turbo.sequence" in units["turbo.engine"]
    found = cycles(units)
    why = {(a, b): sorted({m for m, ts in edges.items() if unit(m) == a for t in ts if unit(t) == b})
           for c in found for a in c for b in c if b in units[a]}
    assert found == [], "cycles among packages: " + "; ".join(" <-> ".join(c) for c in found) + \
        " (through " + "; ".join(f"{a} -> {b}: {', '.join(ms)}" for (a, b), ms in why.items()) + ")"


def test_at_most_15_modules_directly_under_turbo():
    top = sorted(p.name for p in (ROOT / "turbo").glob("*.py"))
    assert len(top) <= 15, f"{len(top)} modules directly under turbo/ (a new one belongs in its package): {top}"


def test_the_public_names_resolve():
    """turbo/__init__.py loads its names by module name (a string the import graph cannot follow)."""
    import turbo

    missing = [name for name in turbo.__all__ if getattr(turbo, name, None) is None]
    assert missing == []


BELOW_CHAT = ("turbo.store", "turbo.load", "turbo.model", "turbo.backends", "turbo.drafters", "turbo.sequence",
              "turbo.vision")
# package -> what none of its modules may import, at any level (TYPE_CHECKING and functions too): the layers
LAYERS = {**{p: ("turbo.chat", "turbo.engine", "turbo.serve") for p in BELOW_CHAT},
          "turbo.chat": ("turbo.engine", "turbo.serve", "turbo.chat_cli", "tui")}


def every_import(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours any import statement of `path` names, wherever it sits."""
    tree = ast.parse(path.read_text(), str(path))
    return {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for t in _targets(name, path.name == "__init__.py", node, known)}


def test_the_layers_import_only_downwards():
    """The chat package works against its own ChatRuntime protocol, never the engine (issue 53); the
    packages below it know neither the chat, the engine nor the server."""
    files = sources()
    known = set(files)
    wrong = [f"{name} imports {t}" for name, path in files.items() for layer, banned in LAYERS.items()
             if name == layer or name.startswith(layer + ".")
             for t in every_import(name, path, known) if any(t == b or t.startswith(b + ".") for b in banned)]
    assert wrong == [], "; ".join(sorted(wrong))

"""The code's shape (issue 29), read from the source with ``ast``: no import cycle inside
profclass/ (typing-only and function-level imports included: each is a dependency a reader
follows), and the size proxies, counted in raw lines: no function over 60 lines, no module
over 450, no dataclass over 20 fields."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 450
MAX_DATACLASS_FIELDS = 20


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root/package``."""
    out = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports anywhere in its file. ``from X import y``
    depends on X.y when that is a module, else on X."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            prefix = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{prefix}.{a.name}" if prefix else a.name
                out.add(full if full in modules else prefix)
    return (out & modules.keys()) - {name}


def import_cycles(root: Path, package: str) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    modules = _modules(root, package)
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return cycles


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or \
                (isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    return False


def oversized(root: Path, package: str) -> list[str]:
    """Every function, module and dataclass over its size limit, with its size."""
    out = []
    for path in sorted((root / package).rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(root)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            out.append(f"{where}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    out.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
            elif isinstance(node, ast.ClassDef) and _is_dataclass(node):
                n = sum(isinstance(b, ast.AnnAssign) for b in node.body)
                if n > MAX_DATACLASS_FIELDS:
                    out.append(f"{where}:{node.lineno} {node.name}: {n} fields")
    return out


def test_no_import_cycle_inside_profclass():
    assert import_cycles(ROOT, "profclass") == []


def test_size_proxies_hold():
    assert oversized(ROOT, "profclass") == []


def test_the_checks_see_a_typing_only_cycle_and_an_oversized_function(tmp_path):
    """The two checks above on a package made to fail them: a cycle closed by a
    TYPE_CHECKING import, a function one line too long, a dataclass one field too many."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .. import a\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n" + "    y = 1\n" * (MAX_FUNCTION_LINES - 1))
    fields = "".join(f"    f{i}: int\n" for i in range(MAX_DATACLASS_FIELDS + 1))
    (pkg / "c.py").write_text(f"from dataclasses import dataclass\n\n@dataclass(frozen=True)\nclass C:\n{fields}")
    assert import_cycles(tmp_path, "pkg") == [["pkg.a", "pkg.sub.b"]]
    assert sorted(oversized(tmp_path, "pkg")) == ["pkg/c.py:4 C: 21 fields", "pkg/sub/b.py:1 f: 61 lines"]

"""Imports point one way: no module of strata_mgpu reaches itself through its imports, read from
the source (every import counts: a function's own and one under TYPE_CHECKING as well), and every
module imports on its own, in a fresh interpreter's module table (an import order that only works
after something else was imported first fails there)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import strata_mgpu

ROOT = Path(strata_mgpu.__file__).resolve().parent


def modules() -> dict[str, Path]:
    """Module name -> its file, every module of the package (packages by their __init__.py)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules `name` imports anywhere in its source ('from P import x' counts as
    P.x where that is a module, else as P)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_finder_sees_a_circle_and_an_import_under_type_checking(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import x\n")
    (tmp_path / "pkg" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from pkg import a\nx = 1\n")
    (tmp_path / "pkg" / "c.py").write_text("from . import b\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    graph = {m: imports_of(m, tmp_path / (m.replace(".", "/") + ("/__init__.py" if m == "pkg" else ".py")), known)
             for m in known}
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.b"}}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_no_module_imports_itself_through_others():
    found = modules()
    graph = {name: imports_of(name, path, set(found)) for name, path in found.items()}
    assert len(graph) > 100 and graph["strata_mgpu.kernels.experts"]  # the walk read the package
    assert cycles(graph) == []


def test_every_module_imports_on_its_own():
    """One interpreter imports each module in turn, the package's modules dropped from its module
    table before each: a module that needs another imported before it fails on its own."""
    script = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "strata_mgpu" or m.startswith("strata_mgpu.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=-2))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""
    names = [n for n in modules() if n != "strata_mgpu.__main__"]  # __main__ runs the CLI
    run = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, timeout=600,
                         cwd=ROOT.parent)
    assert run.returncode == 0, run.stdout + run.stderr

"""The package's shape, read from its source (ast): every import goes to the importer's own
layer or a lower one (``ckpt_controller.LAYERS``), no import cycle, no module past the size
a reader takes in, and the layer order said alike where people read it.

Every import counts, also one inside a function (a lazy import is still a dependency), and
nothing is listed as an exception.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import ckpt_controller
from support import ROOT

PACKAGE = ROOT / "ckpt_controller"
#: the most lines a module may have (a few hundred is the habit; past this, split it)
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    """``ckpt_controller.x.y`` -> its file, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, source: str, is_pkg: bool = False) -> set[str]:
    """The package's modules ``name`` (whose code is ``source``) imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".")
                here = here[:len(here) - node.level + (1 if is_pkg else 0)]
                base = ".".join(here + ([node.module] if node.module else []))
            # ``from pkg import mod`` imports the module; ``from mod import name`` the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("ckpt_controller") and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path.read_text(), path.name == "__init__.py")
         for name, path in MODULES.items()}


def _layer_of() -> dict[str, int]:
    """module -> the index of its layer in ``LAYERS``."""
    top = {}
    for i, (_, members) in enumerate(ckpt_controller.LAYERS):
        for member in members:
            top[member] = i
    out = {}
    for name in MODULES:
        parts = name.split(".")
        key = "__init__" if len(parts) == 1 else parts[1]
        assert key in top, f"{name} is in no layer: add {key!r} to ckpt_controller.LAYERS"
        out[name] = top[key]
    return out


def upward(graph: dict[str, set[str]], layer: dict[str, int]) -> list[str]:
    """Every import from a lower layer to a higher one."""
    names = [n for n, _ in ckpt_controller.LAYERS]
    return sorted(f"{src} ({names[layer[src]]}) imports {dst} ({names[layer[dst]]})"
                  for src, dsts in graph.items() for dst in dsts if layer[dst] > layer[src])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of two modules or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_import_goes_to_the_same_layer_or_a_lower_one():
    assert upward(GRAPH, _layer_of()) == []


def test_no_import_cycle():
    assert cycles(GRAPH) == []


def test_the_checks_see_an_upward_import_and_a_cycle_inside_functions():
    """The checks can fail: source written for the test, whose imports sit inside functions
    (relative and absolute), reaches up a layer and closes a cycle."""
    server = "ckpt_controller.controller.server"
    graph = dict(GRAPH)
    graph[server] = GRAPH[server] | _imports(
        server, "def f():\n    from ..fleet import node\n    from ckpt_controller import serve\n")
    assert graph[server] - GRAPH[server] == {"ckpt_controller.fleet.node",
                                             "ckpt_controller.serve"}
    found = upward(graph, _layer_of())
    assert f"{server} (controller) imports ckpt_controller.fleet.node (fleet, drill)" in found
    assert any(server in c and "ckpt_controller.serve" in c for c in cycles(graph))


def test_no_module_is_past_the_size_a_reader_takes_in():
    long = sorted(f"{path.relative_to(ROOT)}: {n} lines" for path in MODULES.values()
                  if (n := len(path.read_text().splitlines())) > MAX_LINES)
    assert long == []


def _docstring_layers() -> list[str]:
    """The layer names ``ckpt_controller``'s docstring lists, in order."""
    doc = ckpt_controller.__doc__
    block = doc.split("lowest first", 1)[1].split("\n\n", 2)[1]
    return [m.group(1) for line in block.splitlines()
            if (m := re.match(r"    (\S[^ ]*(?:, \S+)?)\s{2,}", line))]


def test_the_layer_order_is_said_alike_in_the_package_and_the_docs():
    names = [n for n, _ in ckpt_controller.LAYERS]
    assert _docstring_layers() == names
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([a-z, ]+?) \| (`.*?) \|", section, re.M)
    assert [name for name, _ in rows] == names
    for (name, modules), (_, members) in zip(rows, ckpt_controller.LAYERS):
        assert re.findall(r"`([\w]+)/?`", modules) == list(members), name

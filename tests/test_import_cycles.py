"""No circles in the package's import graph: every `import` of a mindspeed_rl module, at the top of a file or
inside a function, read from the source, must leave the graph acyclic (a circle means two modules that can only
be understood, and loaded, together)."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "mindspeed_rl"


def module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> nx.DiGraph:
    modules, graph = module_names(), nx.DiGraph()
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    graph.add_edge(name, target, line=node.lineno)
    return graph


def test_the_import_graph_has_no_circles():
    graph = import_graph()
    assert graph.number_of_nodes() > 100, "the graph was read"
    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    where = [[f"{a} -> {b} (line {graph.edges[a, b]['line']})" for a, b in graph.subgraph(c).edges] for c in circles]
    assert not circles, where



def test_no_private_name_is_imported_across_modules():
    """A name one module uses from another is public: `from x import _name` across the package means a helper
    whose users the code does not show."""
    found = []
    for name, path in module_names().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mindspeed_rl")):
                found += [f"{name}: from {'.' * node.level}{node.module or ''} import {a.name} (line {node.lineno})"
                          for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, found

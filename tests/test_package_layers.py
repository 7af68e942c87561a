"""The package's folders import downward only and in no circle.

    python tests/test_package_layers.py     # prints which folder imports which (and how often)

A folder (or top-level module) may import from a folder of a lower layer, or sideways within
its layer, never upward; the folder graph has no cycle. Imports inside functions count too: they
are how a layer would reach upward unseen. The package root (its ``__init__``, a facade) is left
out.
"""

from __future__ import annotations

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "cp_inductor"

# Lowest first. What a pass needs sits below it; the table, the engine and the backend on top.
LAYERS = [
    {"config"},
    {"config_snapshot", "reporting", "batch_layout"},
    {"lowerings"},
    {"parallel", "passes/analysis"},
    {"passes/editing", "passes/record", "passes/guard", "passes/observe"},
    {"passes/detect", "passes/canonicalize", "passes/checked_rewrite"},
    {"passes/post_grad", "passes/dynamo", "passes/joint"},
    {"passes/experimental"},
    {"passes/pipeline"},
    {"passes/engine", "passes/hook_pass", "report_cache"},
    {"backend"},
    {"testing", "demo"},
]
RANK = {group: i for i, layer in enumerate(LAYERS) for group in layer}


def group_of(module: str) -> str:
    """``cp_inductor.passes.post_grad.fused_a2a`` -> ``passes/post_grad``; ``cp_inductor.backend``
    -> ``backend``."""
    parts = module.split(".")[1:]
    if not parts:
        return ""
    if parts[0] == "passes" and len(parts) > 1:
        return "passes/" + parts[1]
    return parts[0]


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def _exists(module: str) -> bool:
    base = ROOT.parent / module.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def module_imports():
    """(importing module, imported module) for every import of the package's own modules."""
    for path in ROOT.rglob("*.py"):
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [f"{target}.{a.name}" for a in node.names]
                targets = [n if _exists(n) else target for n in names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "cp_inductor":
                    yield module, target


def imports() -> collections.Counter:
    """(importing group, imported group) -> how many import statements."""
    edges: collections.Counter = collections.Counter()
    for module, target in module_imports():
        a, b = group_of(module), group_of(target)
        if a and b and a != b:
            edges[(a, b)] += 1
    return edges


def pass_modules() -> set:
    """The modules that define a pass record (a top-level ``PASS``)."""
    found = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PASS" for t in node.targets):
                found.add(_module_name(path))
    return found


def test_every_folder_has_a_layer():
    groups = {g for edge in imports() for g in edge}
    assert groups <= set(RANK), sorted(groups - set(RANK))


def test_no_upward_import():
    upward = [(a, b) for (a, b) in imports() if RANK[b] > RANK[a]]
    assert not upward, upward


def test_no_import_circle_between_folders():
    graph = collections.defaultdict(set)
    for a, b in imports():
        graph[a].add(b)
    state: dict = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in graph[node]:
            assert state.get(nxt) != "open", " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = "done"

    for node in list(graph):
        if node not in state:
            visit(node, [])


def test_only_the_pipeline_imports_a_pass():
    """A pass is known by its record in ``passes/pipeline.py``: no other module imports one
    (what passes share lives in ``analysis/`` or ``editing/``)."""
    passes = pass_modules()
    assert len(passes) > 10, passes
    importers = sorted({(m, t) for m, t in module_imports() if t in passes and m != "cp_inductor.passes.pipeline"})
    assert not importers, importers


if __name__ == "__main__":
    for (a, b), n in sorted(imports().items(), key=lambda kv: (RANK.get(kv[0][0], 99), kv[0])):
        print(f"{a:24s} -> {b:24s} {n}")

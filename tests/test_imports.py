"""The package's import graph follows the pipeline: no cycles, no import from a stage to a later one.

Read from the source (``ast``), function-local imports included: a cycle hidden inside a function
is still a cycle, and so is one through ``if TYPE_CHECKING:`` imports. Those type-only imports are
exempt only from the stage order (a type hint may name a later stage's type). A new
module must be placed in :data:`STAGES`, which is the pipeline order of ``docs/INTERNALS.md``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "vtc_jax"

# Earlier stages first. A module may import only modules listed before it.
STAGES: tuple[str, ...] = (
    # leaves: version shims and test/inspection utilities that know nothing of the pipeline
    "compat", "interpret", "autodiff", "testing",
    # the vocabulary; the deviceless compile (which reads what a kernel call does in it), the
    # index-map algebra, the trace (and, before it, a sharded program made per shard)
    "primitives", "offline", "indexmap", "canonical", "graph", "spmd",
    # movement rules and clustering
    "movement", "cluster",
    # the kernels library (Pallas code generation; imports only the algebra)
    "kernels.tiling", "kernels.vio", "kernels.matmul", "kernels.conv", "kernels.pointwise",
    "kernels.reduction", "kernels.flash", "kernels.attention", "kernels.prefill_attention",
    "kernels.catalog", "kernels",
    # templates: verdicts on clusters and the adapters that build kernels
    "templates.base", "templates.stage2", "templates.island", "templates.contraction",
    "templates.pointwise", "templates.reduction", "templates.attention", "templates",
    # the one model of XLA, selection, VTOG, cost model, strategy, accounting
    "xla_priority", "xla", "selection", "vtog", "costmodel", "profiling", "strategy", "accounting",
    # the analysis, lowering, the build loop, the report, the user surface
    "analysis", "lower", "guard", "program", "plancache", "report", "api",
    # the package and its command line
    "", "cli", "demo", "__main__",
)


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                out.update(id(n) for n in ast.walk(stmt))
    return out


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """``module -> vtc_jax modules it imports`` (names relative to the package; "" is the package).
    ``type_checking``: count the imports under ``if TYPE_CHECKING:`` too."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        skip = set() if type_checking else _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                    mod = ".".join([*base, *([node.module] if node.module else [])])
                elif node.module and (node.module == "vtc_jax" or node.module.startswith("vtc_jax.")):
                    mod = node.module[len("vtc_jax."):] if node.module != "vtc_jax" else ""
                else:
                    continue
                for alias in node.names:   # `from . import x` imports module x, not the package
                    sub = f"{mod}.{alias.name}" if mod else alias.name
                    deps.add(sub if sub in files else mod)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "vtc_jax":
                        deps.add("")
                    elif alias.name.startswith("vtc_jax."):
                        deps.add(alias.name[len("vtc_jax."):])
        deps.discard(name)
        graph[name] = {d for d in deps if d in files}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_reader_sees_function_local_imports(tmp_path):
    """The reader itself: a function-local relative import counts, a TYPE_CHECKING one does not."""
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n"
           "def f():\n    from . import c\n")
    tree = ast.parse(src)
    skip = _type_checking_nodes(tree)
    found = [n.module or n.names[0].name for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom) and id(n) not in skip and n.level]
    assert found == ["c"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_every_module_has_a_stage():
    missing = sorted(set(import_graph()) - set(STAGES))
    assert not missing, f"place these modules in STAGES (pipeline order): {missing}"


def test_no_import_cycles():
    """No cycle even counting type-only imports (the vocabulary names the shapes it reads as
    Protocols instead of importing the tracer's types)."""
    assert _cycles(import_graph(type_checking=True)) == []


def test_imports_only_from_earlier_stages():
    rank = {m: i for i, m in enumerate(STAGES)}
    graph = import_graph()
    upward = sorted((m, d) for m, deps in graph.items() for d in deps
                    if m in rank and d in rank and rank[d] > rank[m])
    assert upward == [], f"imports from a later stage (module, imported): {upward}"


@pytest.mark.parametrize("module, allowed", [
    # the user surface holds no analysis: it calls the analysis, the build and the report
    ("api", {"analysis", "autodiff", "compat", "guard", "plancache", "program", "report", "spmd"}),
    # the build loop and the report read the analysis, never the user surface
    ("program", {"analysis", "compat", "costmodel", "graph", "guard", "interpret", "lower", "primitives",
                 "templates"}),
])
def test_user_surface_and_build_import_only_what_they_use(module, allowed):
    assert import_graph()[module] <= allowed, import_graph()[module] - allowed

"""No import cycle among vtc_jax's modules (module-level imports; TYPE_CHECKING blocks and
function-local imports excluded). Why: a cycle hidden behind a function-local import (the
templates package importing its submodules inside a function, which imported it back) makes the
import order matter and hides what depends on what; shared types live in a module of their own
(``templates/base.py``) instead."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "vtc_jax"


def _name(p: Path) -> str:
    parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in ROOT.rglob("*.py")}


def _imports(mod: str, path: Path) -> set[str]:
    """The vtc_jax modules ``mod`` imports at module level (its own parent packages excluded:
    they are always being imported already)."""
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out: set[str] = set()

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.ImportFrom):
                base = pkg[:len(pkg) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                if target in MODULES and not mod.startswith(target + "."):
                    out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in MODULES)
            visit(ast.iter_child_nodes(node))

    visit(ast.parse(path.read_text()).body)
    return out - {mod}


def test_no_import_cycle():
    deps = {m: _imports(m, p) for m, p in MODULES.items()}
    assert deps["vtc_jax.templates"] >= {"vtc_jax.templates.base", "vtc_jax.templates.attention"}
    done: set[str] = set()

    def walk(m: str, path: list[str]) -> None:
        for d in sorted(deps[m]):
            assert d not in path, " -> ".join(path[path.index(d):] + [d])
            if d not in done:
                walk(d, path + [d])
        done.add(m)

    for m in sorted(deps):
        walk(m, [m])

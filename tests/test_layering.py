"""The package's import graph (every `import`, also those inside functions): no circle, and the kernels import
only the core modules below them (never the reference, the ops, the primitive or the runtime)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cudnn_moe_jax"
# What the kernels may import from the package outside cudnn_moe_jax.kernels: the problem, its operand table and
# the facts the table reads.
KERNEL_IMPORTS = {"_problem", "activations", "formats", "limits", "offsets", "operands", "shapes"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def _imports(name: str, path: Path, known: dict) -> set[str]:
    """The package modules `name` imports (a `from X import Y` counts as X.Y where that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_no_import_circle():
    graph, state, stack, circles = _graph(), {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    # a package's __init__ importing its own submodules is how packages work, not a circle between modules
    circles = [c for c in circles if not any(a.startswith(b + ".") or b.startswith(a + ".") for a, b in zip(c, c[1:]))]
    assert not circles, " ; ".join(" -> ".join(c) for c in circles)


def test_kernels_import_nothing_above_them():
    allowed = {f"cudnn_moe_jax.{m}" for m in KERNEL_IMPORTS} | {"cudnn_moe_jax"}
    for name, deps in _graph().items():
        if name.startswith("cudnn_moe_jax.kernels"):
            upward = {d for d in deps if not d.startswith("cudnn_moe_jax.kernels") and d not in allowed}
            assert not upward, f"{name} imports {sorted(upward)}"

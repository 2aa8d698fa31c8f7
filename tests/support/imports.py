"""The import graph of a package, read with :mod:`ast` (nothing is imported).

Every ``import`` and ``from … import`` counts, at module level and inside functions and
classes alike: an import inside a function hides a dependency, it does not remove it. Left
out: imports under ``if TYPE_CHECKING:`` (they never run) and a module naming itself (a
script such as ``python -m pools.bench.core`` re-imports itself under its own name).

An edge goes to the most specific module of the package that the import names:
``from pools.bench import backlog`` is an edge to ``pools.bench.backlog``, ``from pools
import pooled`` an edge to ``pools`` (its ``__init__``). The parent packages a dotted import
runs on the way are not counted: every module would otherwise depend on ``pools``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

#: An edge: the importing module, the imported one.
Edge = tuple[str, str]


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (found under ``root``) by dotted name."""
    found = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements below ``node``, at any depth, less ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports_in(other)
            continue
        yield from _imports_in(child)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    yield from _imports(node)


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` import starts from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    if keep < 1:
        raise ValueError(f"{module}: relative import beyond the top-level package")
    return ".".join([*parts[:keep], *([node.module] if node.module else [])])


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest prefix of ``name`` that is a module of ``known``."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def targets(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` (its source at ``path``) imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = _base(module, is_package, node)
            names = [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
        for name in names:
            target = _resolve(name, known)
            if target is not None and target != module:
                found.add(target)
    return found


def edges(root: Path, packages: Iterable[str]) -> set[Edge]:
    """Every import edge between the modules of ``packages`` (found under ``root``)."""
    found: dict[str, Path] = {}
    for package in packages:
        found.update(modules(root, package))
    known = set(found)
    return {(m, t) for m, path in found.items() for t in targets(m, path, known)}


def cycles(graph: Iterable[Edge]) -> list[frozenset[str]]:
    """The import cycles: strongly connected components of two modules or more.

    One component stands for every cycle through its modules (Tarjan's algorithm,
    iterative). Sorted by their smallest module name.
    """
    successors: dict[str, list[str]] = {}
    for source, target in sorted(set(graph)):
        successors.setdefault(source, []).append(target)
        successors.setdefault(target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[frozenset[str]] = []
    for start in successors:
        if start in index:
            continue
        work = [(start, iter(successors[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            step = next(pending, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(successors[step])))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(frozenset(component))
    return sorted(components, key=min)


def within(graph: Iterable[Edge], package: str) -> set[Edge]:
    """The edges whose both ends lie in ``package`` (the package itself included)."""

    def inside(name: str) -> bool:
        return name == package or name.startswith(f"{package}.")

    return {(s, t) for s, t in graph if inside(s) and inside(t)}


def imported(root: Path, package: str) -> dict[str, set[str]]:
    """Every absolute name each module of ``package`` imports, third-party ones too.

    ``from a.b import c`` gives ``a.b.c`` (a module or a name in one), relative imports
    resolved; imports under ``if TYPE_CHECKING:`` are left out, as in :func:`targets`.
    """
    found: dict[str, set[str]] = {}
    for module, path in modules(root, package).items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        names: set[str] = set()
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            else:
                base = _base(module, is_package, node)
                names.update(f"{base}.{a.name}" if base else a.name for a in node.names)
        found[module] = names
    return found

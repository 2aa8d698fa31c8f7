"""Import cycles, counting imports inside functions (``tests/support/imports.py``).

The benchmark (``pools.bench``) has none. Elsewhere in ``pools`` and ``pools_admin`` the
cycles left are listed in :data:`KNOWN`: the list may only shrink. A new cycle fails, and so
does a known one that changed or went away while still listed (take it off the list).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.support import imports

ROOT = Path(__file__).resolve().parents[2]

#: The cycles outside the benchmark still to break, each as the set of its modules.
KNOWN: list[set[str]] = []


def graph() -> set[imports.Edge]:
    return imports.edges(ROOT, ["pools", "pools_admin"])


def show(cycle: frozenset[str]) -> str:
    return " <-> ".join(sorted(cycle))


def test_import_cycles__none_inside_the_benchmark():
    found = imports.cycles(imports.within(graph(), "pools.bench"))
    assert not found, "import cycles in pools.bench:\n" + "\n".join(map(show, found))


def test_import_cycles__elsewhere_only_the_known_ones_and_each_still_there():
    found = set(imports.cycles(graph()))
    known = {frozenset(c) for c in KNOWN}
    new = [show(c) for c in sorted(found - known, key=min)]
    gone = [show(c) for c in sorted(known - found, key=min)]
    assert not new, "new import cycles (break them; do not add them to KNOWN):\n" + "\n".join(new)
    assert not gone, "known cycles changed or gone: update KNOWN to what is left:\n" + "\n".join(
        gone
    )


def test_import_cycles__the_benchmark_is_scanned():
    """The scan sees the benchmark's modules and their imports inside functions."""
    edges = imports.within(graph(), "pools.bench")
    assert ("pools.bench.cli", "pools.bench.runner") in edges  # inside cli.run
    assert ("pools.bench.tasks", "pools.bench.recipe") in edges
    assert ("pools.bench.recipe", "pools.bench.bodies") in edges


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_import_cycles__scanner_sees_function_level_and_relative_imports(tmp_path):
    """Sabotage twin: cycles hidden in functions, relative imports and ``from pkg import
    module`` are found; ``TYPE_CHECKING`` imports and a module naming itself are not cycles."""
    write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "def f():\n    from pkg import b\n",
            "pkg/b.py": "from . import a\n",
            "pkg/sub/__init__.py": "from .c import name\n",
            "pkg/sub/c.py": "import pkg.sub.d as d\nname = 1\n",
            "pkg/sub/d.py": "class K:\n    def m(self):\n        from ..sub.c import name\n",
            "pkg/e.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg import f\n"
                "else:\n    import os\n"
                "import pkg.e\n"
            ),
            "pkg/f.py": "from pkg.e import TYPE_CHECKING\n",
        },
    )
    edges = imports.edges(tmp_path, ["pkg"])
    assert ("pkg.a", "pkg.b") in edges and ("pkg.b", "pkg.a") in edges
    assert ("pkg.sub", "pkg.sub.c") in edges
    assert ("pkg.sub.d", "pkg.sub.c") in edges
    assert ("pkg.e", "pkg.f") not in edges and ("pkg.e", "pkg.e") not in edges
    assert imports.cycles(edges) == [
        frozenset({"pkg.a", "pkg.b"}),
        frozenset({"pkg.sub.c", "pkg.sub.d"}),
    ]
    assert imports.cycles(imports.within(edges, "pkg.sub")) == [
        frozenset({"pkg.sub.c", "pkg.sub.d"})
    ]

"""The import rules of docs/concepts/architecture.md, checked on the source.

Imports inside functions count (only ``TYPE_CHECKING`` blocks do not). A rule that must
bend names its exceptions here, each with the reason, so that the page and the code agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import imports

ROOT = Path(__file__).resolve().parents[2]
IMPORTED = {**imports.imported(ROOT, "pools"), **imports.imported(ROOT, "pools_admin")}

#: The engine and what it stands on: no Celery, no kombu, no DRF, no surface above it.
CORE = ("pools.core", "pools.pg", "pools.models", "pools.querysets", "pools.conf")
#: Pure value code: no database, no Django models, nothing of the engine.
PURE = (
    "pools.specs",
    "pools.pool_names",
    "pools.states",
    "pools.pool_fields",
    "pools.rates_text",
    "pools.exceptions",
)
ABOVE_CORE = ("celery", "kombu", "rest_framework", "pools.celery", "pools.api", "pools_admin")


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _breaking(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} imports {name}"
        for module, names in IMPORTED.items()
        if _in(module, sources)
        for name in names
        if _in(name, forbidden)
    )


def test_layers__the_core_imports_neither_celery_nor_drf_nor_a_surface() -> None:
    assert _breaking(CORE, ABOVE_CORE) == []


def test_layers__pure_value_code_touches_no_database_and_no_engine() -> None:
    """Django's choices enums (``django.db.models.TextChoices``) are plain enums: allowed."""
    forbidden = ("django.db", "pools.models", "pools.querysets", "pools.core", "pools.pg")
    found = _breaking(PURE, forbidden)
    assert [f for f in found if not f.endswith(("TextChoices", "IntegerChoices"))] == []


def test_layers__the_surfaces_reach_the_database_through_the_core() -> None:
    """REST, admin and Celery glue never call the PostgreSQL engine themselves.

    The one exception: a worker process opens pools' own connection at start
    (``pools.celery.worker``, ``fastpath.use_own_connection``).
    """
    found = _breaking(("pools.api", "pools_admin", "pools.celery"), ("pools.pg",))
    assert found == ["pools.celery.worker imports pools.pg.fastpath"]


def test_layers__the_core_names_the_postgresql_engine_in_one_place() -> None:
    """Only the engine choice (``pools.core.engine``) knows the PostgreSQL engine exists."""
    found = {line.split(" imports ")[0] for line in _breaking(("pools.core",), ("pools.pg",))}
    assert found <= {"pools.core.engine"}, found


def test_layers__nothing_installed_imports_the_benchmark() -> None:
    """The benchmark is not in the wheel: only the command that runs it may look for it."""
    found = _breaking(("pools", "pools_admin"), ("pools.bench",))
    outside = [f for f in found if not f.startswith(("pools.bench", "pools.management"))]
    assert outside == []


@pytest.mark.parametrize("rule", [CORE, PURE])
def test_layers__the_rules_see_real_modules(rule: tuple[str, ...]) -> None:
    """A guard for the guards: each rule's prefixes match modules that exist."""
    for prefix in rule:
        assert any(_in(module, (prefix,)) for module in IMPORTED), prefix

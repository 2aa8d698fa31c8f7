"""The reference pages list exactly what the code has: metric names, refusal reasons,
settings and system check ids.

Each name the code defines must appear on its page, and each name the page lists must
exist in the code (a page that keeps a removed name is as wrong as one that misses a new
one). The code side is read from the code itself: the metric families the collector
yields, ``pools.metrics.REFUSALS``, the fields of ``PoolsSettings`` and the ``id=`` of
every ``Error``/``Warning`` the check modules build.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from pools import conf, metrics

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _page(relative: str) -> str:
    return (DOCS / relative).read_text(encoding="utf-8")


def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after ``heading`` (header and rule left out)."""
    start = text.rfind("\n", 0, text.index(heading)) + 1  # the heading's whole line
    rows: list[list[str]] = []
    started = False
    lines = text[start:].splitlines()
    for line in lines if heading.startswith("|") else lines[1:]:
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows.append(cells)
        elif started:
            break
    return rows[2:]


def _first_code(cell: str) -> str:
    found = re.search(r"`([^`]+)`", cell)
    assert found is not None, f"no `name` in table cell {cell!r}"
    return found.group(1)


def _differences(code: set[str], page: set[str]) -> dict[str, list[str]]:
    return {"missing from the page": sorted(code - page), "not in the code": sorted(page - code)}


# --------------------------------------------------------------------------- metrics


def metric_names_in_code(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names Prometheus shows for every family the collector yields (counters with
    ``_total``), read with no pool and no budget (every family is yielded anyway)."""
    monkeypatch.setattr(metrics, "read", lambda: [])
    monkeypatch.setattr(metrics, "read_budget_stops", lambda: {})
    families = list(metrics.PoolsCollector().collect())
    return {f.name + ("_total" if f.type == "counter" else "") for f in families}


def metric_names_on_page() -> set[str]:
    rows = _table_rows(_page("concepts/observability.md"), "## Metrics (Prometheus)")
    return {_first_code(row[0]) for row in rows}


def refusal_reasons_on_page() -> set[str]:
    rows = _table_rows(_page("concepts/observability.md"), "### Refusal reasons")
    return {_first_code(row[0]) for row in rows}


def test_metrics__every_metric_is_on_the_observability_page_and_no_other(monkeypatch):
    assert metric_names_in_code(monkeypatch), "the collector yields no family"
    diff = _differences(metric_names_in_code(monkeypatch), metric_names_on_page())
    assert diff == {"missing from the page": [], "not in the code": []}


def test_metrics__every_refusal_reason_is_on_the_observability_page_and_no_other():
    code = set(metrics.REFUSALS.values())
    assert code
    diff = _differences(code, refusal_reasons_on_page())
    assert diff == {"missing from the page": [], "not in the code": []}


# --------------------------------------------------------------------------- settings


def settings_in_code() -> set[str]:
    return {f.name for f in fields(conf.PoolsSettings)}


def settings_on_page() -> set[str]:
    rows = _table_rows(_page("reference/settings.md"), "| Key | Type | Default |")
    return {_first_code(row[0]) for row in rows}


def test_settings__every_key_is_on_the_settings_page_and_no_other():
    diff = _differences(settings_in_code(), settings_on_page())
    assert diff == {"missing from the page": [], "not in the code": []}


def test_settings__every_key_has_its_own_section():
    text = _page("reference/settings.md")
    missing = [key for key in sorted(settings_in_code()) if f"## `{key}`" not in text]
    assert missing == []


# --------------------------------------------------------------------------- checks

CHECK_MODULES = (
    ROOT / "pools" / "checks.py",
    ROOT / "pools" / "celery" / "checks.py",
    ROOT / "pools_admin" / "checks.py",
)
_CHECK_ID = re.compile(r"""\bid\s*=\s*["']((?:pools|pools_admin)\.[CEWID]\d{3})["']""")


def check_ids_in_code() -> set[str]:
    return {m for path in CHECK_MODULES for m in _CHECK_ID.findall(path.read_text("utf-8"))}


def check_ids_on_page() -> set[str]:
    rows = _table_rows(_page("reference/checks.md"), "# System checks")
    return {_first_code(row[0]) for row in rows}


def test_checks__every_check_id_is_on_the_checks_page_and_no_other():
    code = check_ids_in_code()
    assert "pools.E001" in code and "pools_admin.W001" in code  # the scan reads both modules
    diff = _differences(code, check_ids_on_page())
    assert diff == {"missing from the page": [], "not in the code": []}


def test_checks__no_other_module_builds_a_check():
    """Every check id lives in the check modules the test above reads."""
    others = [
        str(path.relative_to(ROOT))
        for package in ("pools", "pools_admin")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path not in CHECK_MODULES and _CHECK_ID.search(path.read_text("utf-8"))
    ]
    assert others == []


# --------------------------------------------------------------------------- @pooled


def test_pooled__the_reference_shows_every_parameter_of_the_one_signature():
    """docs/reference/python-api.md's ``pooled(...)`` block and argument table name exactly
    the parameters of ``PoolSpec.build`` (the one definition of ``@pooled``'s options)."""
    import inspect
    import re

    from pools.specs import PoolSpec

    code = [p for p in inspect.signature(PoolSpec.build).parameters if p != "cls"]
    page = _page("reference/python-api.md")
    block = page.split("## `pooled`", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    shown = re.findall(r"^    (\w+):", block, flags=re.MULTILINE)
    table = re.findall(
        r"^\| `(\w+)` \|", page.split("## `pooled`", 1)[1].split("\n## ", 1)[0], re.M
    )
    assert shown == code
    assert table == code

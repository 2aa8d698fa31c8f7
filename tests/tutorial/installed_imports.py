"""Run by the README test in a fresh virtualenv (``python -I``, JSON on stdin): what the
package and each named extra bring is installed and imports, and Django starts with the
README's apps and pools. Prints ``{"problems": [...], "by_extra": {extra: [modules]}}``.

Standalone: it imports nothing of the test suite, only what the virtualenv has (pip's own
copy of ``packaging`` reads the requirement markers).
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import sys
from typing import Any

from pip._vendor.packaging.requirements import Requirement

problems: list[str] = []


def normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def modules_by_distribution() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for module, dists in md.packages_distributions().items():
        for dist in dists:
            found.setdefault(normal(dist), set()).add(module)
    return found


def requirements(name: str, extra: str) -> list[Requirement]:
    """What ``name`` requires: its base dependencies (``extra`` ""), or what ``extra`` adds."""
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        problems.append(f"{name} is not installed")
        return []
    found = []
    for line in dist.requires or []:
        req = Requirement(line)
        base = req.marker is None or req.marker.evaluate({"extra": ""})
        if not extra and base:
            found.append(req)
        elif extra and not base and req.marker is not None:
            if req.marker.evaluate({"extra": extra}):
                found.append(req)
    return found


def brought(name: str, extra: str, seen: set[str]) -> set[str]:
    """The distributions ``name[extra]`` brings, following the extras they name in turn."""
    for req in requirements(name, extra):
        seen.add(normal(req.name))
        for nested in sorted(req.extras):
            brought(req.name, nested, seen)
    return seen


def imports(dists: set[str], modules: dict[str, set[str]]) -> list[str]:
    """Import every top-level module of ``dists``; what imported."""
    done = []
    for name in sorted(dists):
        if name not in modules:
            problems.append(f"{name}: no importable module installed")
        for module in sorted(modules.get(name, ())):
            if module.startswith("_"):
                continue
            try:
                importlib.import_module(module)
                done.append(module)
            except Exception as exc:
                problems.append(f"import {module} ({name}): {type(exc).__name__}: {exc}")
    return done


def start_django(given: dict[str, Any]) -> None:
    """Django with a new project's apps, the README's apps and its POOLS."""
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=given["new_project_apps"] + given["apps"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        POOLS=given["pools"],
        SECRET_KEY="readme",
    )
    try:
        django.setup()
        for path in given["dotted"]:
            module, _, attr = path.partition(":")
            if attr:
                getattr(importlib.import_module(module), attr)
            else:
                importlib.import_module(module)
    except Exception as exc:
        problems.append(f"{type(exc).__name__}: {exc}")


def main() -> None:
    given = json.load(sys.stdin)
    modules = modules_by_distribution()
    by_extra = {"": imports(brought(given["project"], "", set()), modules)}
    for extra in given["extras"]:
        by_extra[extra] = imports(brought(given["project"], extra, set()), modules)
    start_django(given)
    print(json.dumps({"problems": problems, "by_extra": by_extra}))


if __name__ == "__main__":
    main()

"""The README's install block: what its ``pip install`` line names installs, and imports.

The ``## Install`` section's shell blocks are run in a fresh virtualenv (the wheel under test
in place of the published package, the same extras). Then, in that virtualenv: every
distribution the package and the named extras require (following the extras they name in
turn) is installed and its modules import; Django starts with the apps the section's
``INSTALLED_APPS`` adds (beside a new project's) and its ``POOLS``; the beat scheduler it
names imports.
"""

from __future__ import annotations

import ast
import json
import shlex
from pathlib import Path

import pytest

from tests.tutorial import pages
from tests.tutorial.conftest import PROJECT
from tests.tutorial.reader import Isolation, Reader, StepFailed, project_requirement

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
HEADING = "## Install"

#: Run in the fresh virtualenv with the names the README gives (JSON on stdin).
IMPORTS = Path(__file__).with_name("installed_imports.py")

#: The apps ``django-admin startproject`` lists: what ``...`` stands for in the README.
NEW_PROJECT_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
]


def settings_named(blocks: list[pages.Block]) -> dict[str, object]:
    """The settings the section's Python blocks assign: strings of ``INSTALLED_APPS`` (its
    ``...`` left out), ``POOLS`` and the other literal values."""
    found: dict[str, object] = {}
    for block in blocks:
        if block.lang != "python":
            continue
        for node in ast.parse(block.body).body:
            if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)):
                continue
            name = node.targets[0].id
            if name == "INSTALLED_APPS":
                found[name] = [
                    e.value
                    for e in getattr(node.value, "elts", [])
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)
                ]
            else:
                found[name] = ast.literal_eval(node.value)
    return found


def install_lines(blocks: list[pages.Block]) -> list[str]:
    """The section's ``pip install`` commands."""
    return [
        line.strip()
        for block in blocks
        if block.lang in {"bash", "sh", "console"}
        for line in block.body.splitlines()
        if line.strip().startswith(("pip install", "python -m pip install"))
    ]


def extras_of(line: str) -> list[str]:
    """The extras each install line asks for the project (``[redis,postgres]`` -> names)."""
    words = shlex.split(line, comments=True)
    return [
        extras.strip("[]")
        for word in words
        if (extras := project_requirement(word, PROJECT)) is not None
    ]


def test_readme__install_block_installs_what_it_names_and_it_imports(
    wheel: Path, tmp_path: Path, isolation: Isolation
):
    blocks = pages.blocks(pages.section(README.read_text(), HEADING))
    lines = install_lines(blocks)
    named = settings_named(blocks)
    assert lines, f"{README} {HEADING!r} has no pip install line"
    extras = [e for line in lines for e in extras_of(line)]
    assert extras, f"no install line of {HEADING!r} names {PROJECT}"
    assert "INSTALLED_APPS" in named and "POOLS" in named, named.keys()

    reader = Reader(tmp_path, wheel, PROJECT, isolation)
    try:
        for line in lines:
            reader.sh(reader._installing_the_wheel(line), what=f"{README.name}: {line}")
        given = {
            "project": PROJECT,
            "extras": sorted({x.strip() for e in extras for x in e.split(",") if x.strip()}),
            "apps": named["INSTALLED_APPS"],
            "new_project_apps": NEW_PROJECT_APPS,
            "pools": named["POOLS"],
            "dotted": [v for k, v in named.items() if k.endswith("_SCHEDULER")],
        }
        code = f"python -I {shlex.quote(str(IMPORTS))} <<'EOF'\n{json.dumps(given)}\nEOF"
        printed = reader.sh(code, what="importing what the README installs").stdout
    except StepFailed as exc:
        pytest.fail(f"{exc}\n{reader.report()}", pytrace=False)
    result = json.loads(printed.strip().splitlines()[-1])
    assert result["problems"] == [], "\n".join(result["problems"])
    # The package's own dependencies and each named extra bring modules that import (an
    # extra the package does not offer brings nothing: pip only warns about it).
    empty = [extra or "(no extra)" for extra, modules in result["by_extra"].items() if not modules]
    assert not empty, f"{README.name} installs extras that bring nothing: {empty}"

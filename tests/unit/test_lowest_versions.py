"""``make test-lowest`` installs exactly the floors pyproject.toml declares."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def makefile_pins() -> dict[str, str]:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith("LOWEST_PINS :="))
    pins = line.split(":=", 1)[1].split()
    found = {}
    for pin in pins:
        name, _, version = pin.partition("==")
        found[re.sub(r"\[.*\]", "", name).lower()] = version
    return found


def declared_floors() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {}
    for dep in deps:
        match = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?>=([0-9.]+)", dep)
        assert match, f"dependency without a floor: {dep}"
        floors[match.group(1).lower()] = match.group(3)
    return floors


def _normal(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_lowest_versions__makefile_pins_every_declared_floor_exactly() -> None:
    pins, floors = makefile_pins(), declared_floors()
    assert set(pins) == set(floors), (pins, floors)
    assert {k: _normal(v) for k, v in pins.items()} == {k: _normal(v) for k, v in floors.items()}


def test_lowest_versions__the_check_sees_a_pin_that_drifted() -> None:
    """Sabotage twin: a Makefile pin above its floor is told apart."""
    pins = makefile_pins()
    pins["celery"] = "5.6.0"
    assert {k: _normal(v) for k, v in pins.items()} != {
        k: _normal(v) for k, v in declared_floors().items()
    }

"""``manage.py pools bench`` where the benchmark is not installed (the wheel lacks it).

The wheel leaves ``pools.bench`` out; ``None`` in ``sys.modules`` makes its import fail
the way a missing package does (``ModuleNotFoundError`` naming it).
"""

from __future__ import annotations

import sys

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

import pools
from pools.management.commands import pools as command


def without_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``pools.bench`` unimportable, as in an install from the wheel (undone after)."""
    for name in [n for n in sys.modules if n.startswith("pools.bench.")]:
        monkeypatch.delitem(sys.modules, name)  # imported by earlier tests
    monkeypatch.setitem(sys.modules, "pools.bench", None)


def test_bench_missing__says_how_to_run_it_from_a_checkout(monkeypatch):
    without_bench(monkeypatch)
    with pytest.raises(CommandError) as caught:
        call_command("pools", "bench", "--workloads", "W1")
    message = str(caught.value)
    assert "not part of the installed package" in message
    assert f"django-celery-pools {pools.__version__}" in message
    assert f"tag v{pools.__version__}" in message
    assert "make install" in message
    assert "docs/benchmarks.md" in message
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_bench_missing__help_says_the_same(monkeypatch):
    without_bench(monkeypatch)
    with pytest.raises(CommandError, match="runs from a checkout of the repository"):
        call_command("pools", "bench", "--help")


def test_bench_missing__a_missing_dependency_of_the_benchmark_is_not_hidden(monkeypatch):
    """Sabotage twin: only ``pools.bench`` itself missing gets the checkout message."""

    def import_module(name: str) -> None:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr(command.importlib, "import_module", import_module)
    with pytest.raises(ModuleNotFoundError, match="matplotlib"):
        call_command("pools", "bench")


def test_bench_present__a_checkout_loads_its_command_line():
    """From a checkout (``make install``: an editable install) the benchmark is there."""
    cli = command.load_bench()
    assert cli.__name__ == "pools.bench.cli"
    assert callable(cli.add_arguments) and callable(cli.run)

"""The release archives: the wheel holds what a user needs and nothing they don't.

Builds the sdist and, from it, the wheel into a temporary folder (about 3 s, no network:
``--no-isolation`` uses the build backend of the venv, the ``release`` extra). With
``POOLS_DIST_DIR`` set it checks the archives there instead, as ``make dist`` does for the
files it is about to upload.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import distribution as dist


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dist.Built:
    given = os.environ.get("POOLS_DIST_DIR")
    if given:
        return dist.found(Path(given))
    return dist.build(tmp_path_factory.mktemp("dist"))


def assert_none(problems: list[str]) -> None:
    assert not problems, "\n".join(problems)


def test_wheel__holds_every_module_migration_sql_file_template_and_static_file(built):
    names = dist.wheel_names(built.wheel)
    assert_none(dist.missing(names))
    assert "pools/management/commands/pools.py" in names  # manage.py pools, bench included


def test_wheel__holds_no_tests_docs_scripts_bytecode_or_bench_results(built):
    assert_none(dist.unwanted(dist.wheel_names(built.wheel)))


def test_wheel__leaves_the_benchmark_in_the_repository(built):
    """``pools/bench`` runs from a checkout: in the work tree, in neither archive."""
    bench = {n for n in dist.committable() if n.startswith("pools/bench/")}
    assert "pools/bench/__init__.py" in bench and "pools/bench/cli.py" in bench
    shipped = [*dist.wheel_names(built.wheel), *dist.sdist_names(built.sdist)]
    assert [n for n in shipped if n.startswith("pools/bench")] == []
    # No extra promises it: its dependencies are a dependency group of the checkout.
    assert "bench" not in (dist.wheel_metadata(built.wheel).get_all("Provides-Extra") or [])


def test_wheel__metadata_matches_pyproject_and_pypi_classifiers(built):
    problems = dist.metadata_problems(
        dist.wheel_metadata(built.wheel), dist.wheel_license(built.wheel)
    )
    assert_none(problems)


def test_sdist__holds_the_packages_and_build_files_but_no_tests_or_docs(built):
    names = dist.sdist_names(built.sdist)
    assert_none(dist.sdist_problems(names))
    assert_none(dist.missing(names))


def test_wheel__the_checks_see_a_sabotaged_file_list(built):
    """Sabotage twin: a wheel with a file too many or too few is told apart."""
    names = dist.wheel_names(built.wheel)
    strays = [
        "tests/unit/test_public_api.py",
        "example_project/manage.py",
        "docs/benchmarks.md",
        "scripts/services.sh",
        "pools/__pycache__/conf.cpython-311.pyc",
        "pools/bench/cli.py",
        "pools/bench/bench.json",
        "pools/bench/w1-throughput.png",
        "pools_admin/static/pools_admin/results.csv",
        "pools/tests/test_models.py",
    ]
    found = dist.unwanted(names + strays)
    assert [s for s in strays if not any(s in problem for problem in found)] == []

    migration = next(n for n in names if n.startswith("pools/migrations/0"))
    without = [n for n in names if n != migration and not n.startswith("pools/pg/sql/")]
    without.remove("pools/py.typed")
    found = dist.missing(without)
    assert f"module missing: {migration}" in found
    assert "no stored-function file in pools/pg/sql/" in found
    assert "pools/py.typed missing" in found

    sdist = [*dist.sdist_names(built.sdist), "tests/conftest.py", "pools/bench/runner.py"]
    found = dist.sdist_problems(sdist)
    assert "not for the sdist: tests/conftest.py" in found
    assert "not packaged (runs from a checkout): pools/bench/runner.py" in found


def test_wheel__the_checks_see_sabotaged_metadata(built):
    """Sabotage twin: a version, classifier or licence that drifted is told apart."""
    meta = dist.wheel_metadata(built.wheel)
    meta.replace_header("Version", "0.0.9")
    del meta["Classifier"]
    meta["Classifier"] = "Framework :: Celery :: 9"
    found = dist.metadata_problems(meta, "not the licence")
    assert any(p.startswith("Version '0.0.9' is not pyproject's") for p in found)
    assert "unknown classifier: Framework :: Celery :: 9" in found
    assert "no classifier 'Programming Language :: Python :: 3.11'" in found
    assert "the wheel's LICENSE differs from the repository's" in found

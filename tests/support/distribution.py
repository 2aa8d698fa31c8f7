"""What a release's wheel and sdist must hold, and must not.

Each check takes the archive's file names (and metadata) and returns the problems it found,
so that a test can feed it a doctored list and see it fail. ``build`` makes the archives the
way ``make dist`` does: the sdist first, then the wheel from that sdist, so the wheel holds
only what the sdist carries (a wheel built from the work tree also ships whatever a previous
build left in ``build/lib``).
"""

from __future__ import annotations

import email.parser
import functools
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from email.message import Message
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]

#: The importable packages a user installs.
PACKAGES = ("pools", "pools_admin")
#: Folders of the packages that stay in the repository: the benchmark runs from a checkout
#: (docs/benchmarks.md). Neither archive holds them.
NOT_PACKAGED = ("pools/bench",)
#: Suffixes a file in the installed packages may have (``py.typed`` is named on its own).
PACKAGE_SUFFIXES = {".py", ".sql", ".html", ".js", ".css"}
#: Top-level folders of the repository that are never installed.
NOT_SHIPPED = ("tests", "example_project", "docs", "scripts", ".venv", "build", "dist")
#: What the sdist holds at its top level besides the packages (tests and docs stay in the
#: repository: they need its services, Makefile and example project to run or build).
SDIST_FILES = {"PKG-INFO", "pyproject.toml", "README.md", "LICENSE", "setup.cfg"}
#: Classifiers a release must carry, by prefix.
REQUIRED_CLASSIFIERS = (
    "Development Status :: ",
    "Framework :: Celery",
    "Framework :: Django :: 5.2",
    "Intended Audience :: Developers",
    "Operating System :: ",
    "Programming Language :: Python :: 3.11",
    "Topic :: ",
)


@dataclass(frozen=True)
class Built:
    """The two archives of one build."""

    wheel: Path
    sdist: Path


def build(out: Path) -> Built:
    """Build the sdist, then the wheel from it, into ``out`` without build isolation.

    The build runs on a copy of the files git would commit (tracked and new, not ignored):
    setuptools also packs what an earlier build left in the tree (``*.egg-info/SOURCES.txt``
    lists files once packed, ``build/lib`` keeps deleted modules).
    """
    with tempfile.TemporaryDirectory(prefix="pools-dist-") as tmp:
        tree = Path(tmp) / "tree"
        for name in committable():
            target = tree / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target)
        done = subprocess.run(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)],
            capture_output=True,
            text=True,
        )
    if done.returncode:
        raise RuntimeError(f"python -m build failed:\n{done.stdout}\n{done.stderr}")
    return found(out)


@functools.cache
def committable() -> tuple[str, ...]:
    """The work tree's files that git tracks or would add (ignored files left out)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return tuple(sorted(n for n in set(listed.split("\0")) if n and (ROOT / n).is_file()))


def found(out: Path) -> Built:
    """The one wheel and the one sdist in ``out`` (as ``make dist`` leaves them in dist/)."""
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, f"expected one wheel and one sdist: {out}"
    return Built(wheel=wheels[0], sdist=sdists[0])


def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def wheel_metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


def wheel_license(wheel: Path) -> str | None:
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.endswith(".dist-info/licenses/LICENSE"):
                return archive.read(name).decode()
    return None


def sdist_names(sdist: Path) -> list[str]:
    """The sdist's file names without its ``<name>-<version>/`` prefix."""
    with tarfile.open(sdist) as archive:
        return [
            str(PurePosixPath(*PurePosixPath(m.name).parts[1:]))
            for m in archive.getmembers()
            if m.isfile()
        ]


def project() -> dict[str, object]:
    table: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return table


def not_packaged(name: str) -> bool:
    """True for a file of :data:`NOT_PACKAGED` (a path inside the packages)."""
    return any(name.startswith(f"{folder}/") for folder in NOT_PACKAGED)


def source_files(*, suffixes: set[str], under: str) -> set[str]:
    """The files :func:`build` packs from below ``under`` with these suffixes."""
    return {
        name
        for name in committable()
        if name.startswith(f"{under}/")
        and PurePosixPath(name).suffix in suffixes
        and not not_packaged(name)
    }


def missing(names: list[str]) -> list[str]:
    """What a user needs that the package file list lacks."""
    have = set(names)
    problems = []
    for package in PACKAGES:
        for path in sorted(source_files(suffixes={".py"}, under=package) - have):
            problems.append(f"module missing: {path}")
    migrations = [
        n
        for n in names
        if PurePosixPath(n).parent.as_posix() == "pools/migrations"
        and re.fullmatch(r"\d{4}_\w+\.py", PurePosixPath(n).name)
    ]
    if not migrations:
        problems.append("no migration in pools/migrations/")
    sql = source_files(suffixes={".sql"}, under="pools/pg/sql")
    if not any(n.startswith("pools/pg/sql/") and n.endswith(".sql") for n in names):
        problems.append("no stored-function file in pools/pg/sql/")
    problems += [f"SQL file missing: {path}" for path in sorted(sql - have)]
    for folder in ("templates", "static"):
        files = source_files(suffixes=PACKAGE_SUFFIXES, under=f"pools_admin/{folder}")
        if not files:
            problems.append(f"pools_admin/{folder} has no files in the work tree")
        problems += [f"admin file missing: {path}" for path in sorted(files - have)]
    if "pools/py.typed" not in have:
        problems.append("pools/py.typed missing")
    return problems


def unwanted(names: list[str]) -> list[str]:
    """What the wheel holds that a user does not need."""
    problems = []
    for name in names:
        path = PurePosixPath(name)
        top = path.parts[0]
        if top.endswith(".dist-info"):
            continue
        if top not in PACKAGES:
            problems.append(f"outside the packages: {name}")
        elif not_packaged(name):
            problems.append(f"not packaged (runs from a checkout): {name}")
        elif "__pycache__" in path.parts or path.suffix in {".pyc", ".pyo"}:
            problems.append(f"compiled file: {name}")
        elif path.suffix not in PACKAGE_SUFFIXES and name != "pools/py.typed":
            problems.append(f"not code, SQL, template or static file: {name}")
        elif any(part in {"tests", "test"} for part in path.parts[:-1]):
            problems.append(f"tests: {name}")
    return problems


def metadata_problems(meta: Message, license_text: str | None) -> list[str]:
    """The wheel's metadata against pyproject.toml and what PyPI accepts."""
    import trove_classifiers

    import pools

    declared = project()
    problems = []
    for field, key in (
        ("Name", "name"),
        ("Version", "version"),
        ("Requires-Python", "requires-python"),
    ):
        if meta[field] != declared[key]:
            problems.append(f"{field} {meta[field]!r} is not pyproject's {declared[key]!r}")
    if meta["Version"] != pools.__version__:
        problems.append(
            f"Version {meta['Version']!r} is not pools.__version__ {pools.__version__!r}"
        )
    if meta["License-Expression"] != declared["license"]:
        problems.append(f"License-Expression {meta['License-Expression']!r}")
    classifiers = meta.get_all("Classifier") or []
    if classifiers != declared["classifiers"]:
        problems.append(f"classifiers differ from pyproject's: {classifiers}")
    problems += [
        f"unknown classifier: {c}" for c in classifiers if c not in trove_classifiers.classifiers
    ]
    for prefix in REQUIRED_CLASSIFIERS:
        if not any(c.startswith(prefix) for c in classifiers):
            problems.append(f"no classifier {prefix!r}")
    if license_text is None:
        problems.append("LICENSE missing from the wheel's dist-info")
    elif license_text != (ROOT / "LICENSE").read_text():
        problems.append("the wheel's LICENSE differs from the repository's")
    return problems


def sdist_problems(names: list[str]) -> list[str]:
    """The sdist: the packages and the files to build them, no tests, docs, benchmark or
    results (the wheel is built from the sdist, so what it lacks the wheel lacks too)."""
    problems = [f"missing from the sdist: {f}" for f in sorted(SDIST_FILES - set(names))]
    for name in names:
        path = PurePosixPath(name)
        top = path.parts[0]
        if len(path.parts) == 1:
            if name not in SDIST_FILES:
                problems.append(f"unexpected top-level file: {name}")
        elif top in NOT_SHIPPED:
            problems.append(f"not for the sdist: {name}")
        elif top.endswith(".egg-info"):
            continue
        elif "__pycache__" in path.parts or path.suffix in {".pyc", ".pyo"}:
            problems.append(f"compiled file: {name}")
        elif top not in PACKAGES:
            problems.append(f"outside the packages: {name}")
        elif not_packaged(name):
            problems.append(f"not packaged (runs from a checkout): {name}")
        elif path.suffix not in PACKAGE_SUFFIXES and name != "pools/py.typed":
            problems.append(f"not code, SQL, template or static file: {name}")
    return problems


if __name__ == "__main__":  # make dist: python -m tests.support.distribution dist
    print(build(Path(sys.argv[1]).resolve()))

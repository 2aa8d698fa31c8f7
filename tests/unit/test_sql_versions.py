"""A shipped stored-function file never changes: a change is a new version and a migration.

Each ``pools/pg/sql/admission_vN.sql`` is created by a migration that other databases have
already applied; editing it would make fresh installs and upgraded ones run different
functions under the same name. So the files are pinned here by checksum. To change the
functions, add ``admission_v(N+1).sql`` and a migration that creates it (vN stays until the
next release drops it: expand/contract, see docs/howto/upgrading.md),
switch the callers (:mod:`pools.pg.fastpath` users) to it, and pin the new file below.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pools

SQL_DIR = Path(pools.__file__).resolve().parent / "pg" / "sql"
MIGRATIONS = Path(pools.__file__).resolve().parent / "migrations"

#: sha256 of every shipped version file.
PINNED = {
    "admission_v1.sql": "9e090804ced08415eb6aacb0906521bdd64efe1aeaf59cdd590cfaf910d344dc",
    "admission_v2.sql": "d9f94e58508d763f2d1d995e4b4716332f7fbef6381a2e8e4661ea3ca90e5f3b",
    "admission_v3.sql": "eaf24b6e10beb08cd00132d6345209985967b1dd65ae7debf50127926a5d03e5",
    "admission_v4.sql": "8852b6cf704cf4dea38c5fbf8d1b2c5bad24d9ee3db954b0c2268dc40185608c",
    "admission_v5.sql": "01838546b02fde592f3e91e8cb68fbbd8079ebd3bd4a0aa23b9cc09958e87c11",
    "admission_v6.sql": "759075168175575d2ce32f8ed54dc59d0eefe89ccd04dcb9600bbc73fe2b50e0",
    "admission_v7.sql": "edae5786cd7810bdd7a57f446eed6cd5540452629849715d7a88e289aa9097ac",
}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sql_versions__shipped_files_are_unchanged() -> None:
    changed = {
        name: _digest(SQL_DIR / name) for name in PINNED if _digest(SQL_DIR / name) != PINNED[name]
    }
    assert not changed, (
        f"shipped SQL files changed: {sorted(changed)}. Never edit a released "
        "admission_vN.sql: put the change in a new version file with a new migration."
    )


def test_sql_versions__every_version_file_is_pinned() -> None:
    files = {p.name for p in SQL_DIR.glob("admission_v*.sql")}
    assert files == set(PINNED), f"pin the checksum of {sorted(files - set(PINNED))}"


def test_sql_versions__the_callers_use_the_latest_version_and_a_migration_creates_it() -> None:
    latest = max(int(re.search(r"v(\d+)", name).group(1)) for name in PINNED)  # type: ignore[union-attr]
    package = Path(pools.__file__).resolve().parent
    called = set()
    for module in ("core/admission.py", "core/leases.py", "pg/fastpath.py"):
        called |= set(re.findall(r"pools_[a-z]+_v(\d+)", (package / module).read_text()))
    assert called == {str(latest)}, f"callers use versions {sorted(called)}, latest is v{latest}"
    # A version file may carry a suffix naming its change (e.g. admission_v8_rates.sql).
    created = re.compile(rf"admission_v{latest}(_[a-z]+)?\.sql")
    creators = [m.name for m in MIGRATIONS.glob("0*.py") if created.search(m.read_text())]
    assert creators, f"no migration creates admission_v{latest}.sql"

"""The wheel under test, built once per run; the services a page needs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import require_service
from tests.support import distribution
from tests.tutorial.reader import Isolation

#: The name a reader's ``pip install`` line gives the project (normalized).
PROJECT = "django-celery-pools"


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built as ``make dist`` builds it (``python -m build --no-isolation`` from
    the files git would commit)."""
    return distribution.build(tmp_path_factory.mktemp("dist")).wheel


@pytest.fixture
def isolation() -> Isolation:
    """The Redis database and PostgreSQL database name a reader's project uses."""
    return Isolation(
        redis_db=int(os.environ.get("POOLS_QUICKSTART_REDIS_DB", "1")),
        pg_name=os.environ.get("POOLS_QUICKSTART_PG_NAME", "t33_quickstart"),
    )


@pytest.fixture
def redis_db(isolation: Isolation) -> Iterator[int]:
    """The reader's Redis database, empty (messages of an earlier run would be consumed)."""
    require_service("Redis", "127.0.0.1", 6379)
    import redis

    client = redis.Redis(host="127.0.0.1", port=6379, db=isolation.redis_db)
    try:
        client.flushdb()
        yield isolation.redis_db
    finally:
        client.close()


@pytest.fixture
def pg_database(isolation: Isolation) -> Iterator[str]:
    """The reader's PostgreSQL database: created for the test, dropped after it (a user
    creates it by hand: the page says ``createdb``)."""
    require_service("PostgreSQL", "127.0.0.1", 5432)
    import psycopg

    def admin(sql: str) -> None:
        with psycopg.connect(
            "host=127.0.0.1 user=postgres dbname=postgres", autocommit=True
        ) as conn:
            conn.execute(sql)

    name = isolation.pg_name
    admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

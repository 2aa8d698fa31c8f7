"""Idempotency under concurrency: N processes submitting the same key at the same moment
create exactly one entry, and every one of them gets its task id (real PostgreSQL)."""

from __future__ import annotations

import pytest

from pools.models import QueueEntry
from tests.conftest import POOL_APPS
from tests.support import idempotency_race
from tests.support.factories import make_pool

pytestmark = [
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
    pytest.mark.postgres,
]

PROCESSES = 8


@pytest.mark.parametrize("pools", [["race-a"], ["race-a", "race-b"]], ids=["one-pool", "two-pools"])
def test_same_key_from_many_processes__one_entry_and_one_task_id(pools: list[str]) -> None:
    """Two pools: no pool lock is shared, the unique index alone decides."""
    for name in pools:
        make_pool(name, 1)
    reports = idempotency_race.run(processes=PROCESSES, pools=pools, key="order-42")
    assert [r[3] for r in reports if r[3]] == []  # no child failed
    created = [r for r in reports if r[2]]
    assert len(created) == 1
    assert {r[1] for r in reports} == {created[0][1]}
    (entry,) = QueueEntry.objects.all()
    assert (entry.key, entry.idempotency_key) == (created[0][1], "order-42")


def test_skip_from_many_processes__one_entry_of_the_job() -> None:
    make_pool("race-a", 1)
    reports = idempotency_race.run(
        processes=PROCESSES, pools=["race-a"], key="job:nightly", skip_job="nightly"
    )
    assert [r[3] for r in reports if r[3]] == []
    assert sum(1 for r in reports if r[2]) == 1
    assert len({r[1] for r in reports}) == 1
    assert QueueEntry.objects.filter(job="nightly").count() == 1


def test_debounce_from_many_processes__one_waiting_entry_that_collapsed_every_call() -> None:
    """Debounced calls of one key from many processes at once (docs/howto/debounce.md)."""
    make_pool("race-a", 1)
    reports = idempotency_race.run(
        processes=PROCESSES, pools=["race-a"], key="tenant-7", debounce=True
    )
    assert [r[3] for r in reports if r[3]] == []
    (entry,) = QueueEntry.objects.all()
    ids = sorted(f"race-{i}" for i in range(PROCESSES))
    assert sorted([*entry.options["debounced"], entry.key]) == ids
    assert entry.args == [int(entry.key.split("-")[1])]  # the last call's arguments
    assert (entry.state, entry.debounce_key) == ("waiting", "tenant-7")

"""Snapshots count and page held entries by what they are doing (admitted or running)."""

from __future__ import annotations

import pytest

from pools.core import entry_pages, leases, snapshots
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
    pytest.mark.usefixtures("admission_path"),  # both paths on PostgreSQL
]


def test_counts__a_started_entry_counts_as_running_not_admitted(recorder: RecordingBridge) -> None:
    make_pool("p", 2)
    submit(key="started")
    submit(key="admitted")
    started = next(a for a in recorder.admissions if a.key == "started")
    assert leases.start(started.entry_id, started.token, worker="w1") is not None

    snap = snapshots.snapshot("p")
    assert (snap.counts["running"], snap.counts["admitted"]) == (1, 1)
    running = entry_pages.entries_page("p", state="running").items
    admitted = entry_pages.entries_page("p", state="admitted").items
    assert [i.key for i in running] == ["started"]
    assert [i.key for i in admitted] == ["admitted"]


def test_line_items__state_is_an_entry_state(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="held")
    submit(key="waits")
    snap = snapshots.snapshot("p")
    items = [*snap.holders, *snap.head]
    assert [(i.key, i.state) for i in items] == [
        ("held", EntryState.ADMITTED),
        ("waits", EntryState.WAITING),
    ]
    assert all(type(i.state) is EntryState for i in items)  # not the plain str of the row

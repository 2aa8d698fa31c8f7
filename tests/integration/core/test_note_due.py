"""The sweep finds delayed line rows that their pool's ``next_due_at`` does not cover.

An enqueue inside a caller's transaction brings ``next_due_at`` forward only after the
commit; a process that dies in between leaves such rows. On every database (the sweep
runs everywhere); the sabotage twin shows the rows are otherwise never admitted.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from pools.core import admission, sweeps
from pools.models import Demand, Pool, QueueEntry
from pools.states import DELAYED, EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)


def _orphan(pool: Pool, key: str) -> None:
    """An entry out of line, due a second ago, its pool's ``next_due_at`` never set."""
    due = timezone.now() - timedelta(seconds=1)
    entry = QueueEntry.objects.create(
        key=key, task_name="tests.fake", demand={pool.name: 1}, enqueued_at=due
    )
    Demand.objects.create(entry=entry, pool=pool, slots=1, state=DELAYED, enqueued_at=due)


@pytest.mark.parametrize("repair", [True, False], ids=["sweep", "sabotage-no-repair"])
def test_sweep__admits_delayed_rows_its_pool_does_not_know_of(
    recorder: RecordingBridge, monkeypatch: pytest.MonkeyPatch, repair: bool
) -> None:
    pool = make_pool("p", 1)
    _orphan(pool, "a")
    assert Pool.objects.get(name="p").next_due_at is None
    if not repair:
        monkeypatch.setattr(admission, "note_due_entries", lambda: 0)
    sweeps.sweep()
    assert (recorder.keys() == ["a"]) is repair
    state = QueueEntry.objects.get(key="a").state
    assert state == (EntryState.ADMITTED if repair else EntryState.WAITING)


def test_note_due_entries__touches_only_pools_that_need_it(recorder: RecordingBridge) -> None:
    make_pool("fine", 1)
    later = make_pool("late", 1)
    _orphan(later, "a")
    Pool.objects.filter(name="late").update(next_due_at=timezone.now() + timedelta(hours=1))
    assert admission.note_due_entries() == 1
    assert admission.note_due_entries() == 0
    due = Pool.objects.get(name="late").next_due_at
    assert due is not None and due < timezone.now()

"""The fenced start (PostgreSQL, pools' own connection): no write, yet one body at a time.

A worker's start takes the entry's fence (a session advisory lock, :mod:`pools.pg.fence`)
and, with two thirds of the lease left and no rated pool, writes nothing: the entry stays
``admitted``; the first renewal marks it running and the settle records when and where it
started. A duplicate delivery of the same claim, started on another session while the
first body runs, is refused. Each thread here has its own session, as each pool process
of a worker has. The sabotage twin takes the fence away behind the first body's back and
shows the check then sees two bodies at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone

from pools.core import admission, leases, settling
from pools.core.records import Claim
from pools.models import QueueEntry
from pools.pg import fastpath, fence
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]


def _row_version(entry_id: int) -> tuple[str, str]:
    """The entry row's (xmin, ctid): both change when anything writes the row."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT xmin::text, ctid::text FROM pools_queueentry WHERE queue_id = %s", [entry_id]
        )
        row = cursor.fetchone()
    assert row is not None
    return str(row[0]), str(row[1])


def _in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on another thread (its own sessions, as another pool process has)."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)
        finally:
            fastpath.close_own_connection()
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0] if out else None


def _admitted(recorder: Any, key: str = "a") -> Any:
    make_pool("p", 1)
    assert submit("p", key=key).admitted
    return recorder.admissions[-1]


def test_fenced_start__writes_nothing_and_the_settle_records_the_start(recorder, own):
    adm = _admitted(recorder)
    before = _row_version(adm.entry_id)
    claim = leases.start(adm.entry_id, adm.token, worker="w1@host")
    assert claim is not None and not claim.start_written
    assert fastpath.fenced_entry() == adm.entry_id
    assert _row_version(adm.entry_id) == before  # no write at all
    entry = QueueEntry.objects.get(pk=adm.entry_id)
    assert (entry.state, entry.started_at, entry.worker) == (EntryState.ADMITTED, None, "")
    assert admission.settle(
        adm.entry_id,
        adm.token,
        "succeeded",
        live_lease=True,
        started_at=claim.started_at,
        worker=claim.worker,
    )
    entry.refresh_from_db()
    assert (entry.state, entry.started_at, entry.worker) == (
        EntryState.SUCCEEDED,
        claim.started_at,
        "w1@host",
    )


def test_fenced_start__the_first_renewal_marks_it_running(recorder, own):
    adm = _admitted(recorder)
    claim = leases.start(adm.entry_id, adm.token, worker="w1")
    assert claim is not None and claim.started_at is not None
    assert leases.renew(adm.entry_id, adm.token, started_at=claim.started_at, worker="w1")
    entry = QueueEntry.objects.get(pk=adm.entry_id)
    assert (entry.state, entry.started_at, entry.worker) == (
        EntryState.RUNNING,
        claim.started_at,
        "w1",
    )


def test_fenced_start__a_stale_token_does_not_start_and_holds_no_fence(recorder, own):
    adm = _admitted(recorder)
    assert leases.start(adm.entry_id, adm.token - 1, worker="w") is None
    assert fastpath.fenced_entry() == 0
    # The fence is free: another session starts the current token.
    assert _in_thread(lambda: leases.start(adm.entry_id, adm.token, worker="w2")) is not None


def test_fenced_start__a_short_lease_or_a_rated_pool_writes_the_start(recorder, own):
    adm = _admitted(recorder)
    QueueEntry.objects.filter(pk=adm.entry_id).update(
        lease_expires_at=timezone.now() + timedelta(seconds=1)
    )
    claim = leases.start(adm.entry_id, adm.token, worker="w")
    assert claim is not None and claim.start_written
    assert QueueEntry.objects.get(pk=adm.entry_id).state == EntryState.RUNNING
    assert fastpath.fenced_entry() == adm.entry_id  # held all the same

    make_pool("rated", 1, rate="100000/s")
    assert submit("rated", key="r").admitted
    rated = recorder.admissions[-1]
    claim = leases.start(rated.entry_id, rated.token, worker="w")
    assert claim is not None and claim.start_written
    assert fastpath.fenced_entry() == rated.entry_id  # the previous fence was released


def test_fenced_start__an_unstarted_requeue_leaves_a_fenced_entry_alone(recorder, own):
    adm = _admitted(recorder)
    assert leases.start(adm.entry_id, adm.token, worker="w") is not None

    def requeue() -> bool:
        return settling.requeue(
            adm.entry_id, adm.token, reason="publish failed", admit=False, unstarted=True
        )

    assert _in_thread(requeue) is False
    fastpath.release_fence(adm.entry_id)
    assert fastpath.fenced_entry() == 0
    assert _in_thread(requeue) is True


def _duplicate_deliveries(recorder: Any, *, sabotage: bool) -> list[Claim]:
    """Two deliveries of one claim: the first body holds its start while the second, on
    another session, starts. Returns the claims held at once (one body each)."""
    adm = _admitted(recorder)
    first = leases.start(adm.entry_id, adm.token, worker="w1")
    assert first is not None and not first.start_written
    if sabotage:  # the first body's fence is gone behind its back
        fastpath._connect().execute("SELECT pg_advisory_unlock(%s, %s)", fence.key(adm.entry_id))
    second = _in_thread(lambda: leases.start(adm.entry_id, adm.token, worker="w2"))
    return [c for c in (first, second) if c is not None]


def test_fenced_start__a_duplicate_delivery_never_runs_a_second_body_at_once(recorder, own):
    running = _duplicate_deliveries(recorder, sabotage=False)
    assert len(running) == 1
    claim = running[0]
    # After the first body settles, the duplicate finds the entry settled.
    assert admission.settle(claim.entry_id, claim.token, "succeeded", live_lease=True)
    assert _in_thread(lambda: leases.start(claim.entry_id, claim.token, worker="w2")) is None


def test_fenced_start__sabotage_without_the_fence_two_bodies_run_at_once(recorder, own):
    """The check above can fail: with the fence released, the duplicate starts too."""
    assert len(_duplicate_deliveries(recorder, sabotage=True)) == 2


def test_fenced_start__behind_a_transaction_pooler_the_start_is_written(recorder, own, settings):
    settings.POOLS = {**settings.POOLS, "PREPARED_STATEMENTS": False}
    adm = _admitted(recorder)
    claim = leases.start(adm.entry_id, adm.token, worker="w")
    assert claim is not None and claim.start_written
    assert QueueEntry.objects.get(pk=adm.entry_id).state == EntryState.RUNNING
    assert fastpath.fenced_entry() == 0

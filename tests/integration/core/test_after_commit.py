"""After the admitting transaction commits, nothing can leave an admitted entry unpublished,
and the caller that happened to admit it does not fail for its sake.

* A reply row of the fast path decodes whatever the entry stored: arguments kept as
  display text (Celery's ``argsrepr`` of dates, bytes, UUIDs ...) are a ``jsonb`` string,
  which pools' own connection hands over decoded and Django's connection as JSON text.
* A bridge that cannot publish at all puts each admitted entry back in line at once.
* An admission pass that fails after the caller's change committed is logged and asked
  for again with a wake-up; the caller's call returns.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from pools.core import admission, dispatch, pass_runs
from pools.core.records import Admission
from pools.models import Pool, QueueEntry
from pools.pg import fastpath, functions
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)

#: What the gate stores for a call whose arguments JSON cannot carry as they are.
SHOWN = "(datetime.date(2026, 12, 5), b'\\x00\\xff')"


def test_decode__a_jsonb_string_stays_the_string_it_is() -> None:
    columns = ["o_kind", "o_args", "o_kwargs", "o_demand"]
    decoded = fastpath.decode(columns, [("admitted", SHOWN, {"a": [1]}, {"p": 1})])
    assert decoded.rows[0].args == SHOWN
    assert decoded.rows[0].kwargs == {"a": [1]}
    text = fastpath.decode(
        columns,
        [("admitted", f'"{SHOWN}"'.replace("\\", "\\\\"), '{"a": [1]}', '{"p": 1}')],
        jsonb_as_text=True,
    )
    assert text.rows[0].args == SHOWN
    assert text.rows[0].demand == {"p": 1}


@pytest.mark.postgres
def test_after_commit__a_settle_on_the_own_connection_admits_an_entry_with_display_text(
    recorder: RecordingBridge, own: None
) -> None:
    make_pool("p", 1)
    first = submit("p", key="holder")
    assert first.admitted
    submit("p", key="typed", args=SHOWN, kwargs="{'at': UUID('6a1c...')}")
    holder = recorder.admissions[0]
    connection.close()  # as in a worker: the settle runs on pools' own connection
    assert admission.settle(holder.entry_id, holder.token, "succeeded", live_lease=True)
    typed = recorder.admissions[-1]
    assert typed.key == "typed"
    assert typed.args == SHOWN
    assert QueueEntry.objects.get(key="typed").state == EntryState.ADMITTED


@pytest.mark.postgres
def test_after_commit__an_enqueue_on_the_own_connection_admits_display_text(
    recorder: RecordingBridge, own: None
) -> None:
    make_pool("p", 1)
    assert submit("p", key="typed", args=SHOWN).admitted
    assert recorder.admissions[-1].args == SHOWN


class _Broken(RecordingBridge):
    def publish(self, admissions: Any) -> None:
        raise ConnectionError("broker unreachable")


broken = _Broken()


def test_after_commit__a_bridge_that_cannot_publish_puts_the_entry_back_at_once(
    settings: Any, admission_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings.POOLS = {
        **settings.POOLS,
        "PUBLISHER": "tests.integration.core.test_after_commit.broken",
    }
    make_pool("p", 1)
    enqueued = submit("p", key="a")  # the caller does not fail
    entry = QueueEntry.objects.get(key="a")
    assert enqueued.entry_id == entry.queue_id
    assert entry.state == EntryState.WAITING, "left admitted until its lease lapses"
    assert entry.reason.startswith("publish failed: broker unreachable")
    assert Pool.objects.get(name="p").held == 0
    assert "requeueing them" in caplog.text


def test_after_commit__a_failing_follow_up_pass_does_not_fail_the_settle(
    recorder: RecordingBridge, admission_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_pool("p", 1)
    make_pool("q", 1)
    submit("p", key="holder")
    holder = recorder.admissions[0]
    submit({"p": 1, "q": 1}, key="both")  # a multi-pool head: its pass follows the settle

    def fail(names: Any) -> Any:
        raise RuntimeError("pool state unavailable")

    monkeypatch.setattr(pass_runs, "run_pass", fail)
    assert admission.settle(holder.entry_id, holder.token, "succeeded")
    assert QueueEntry.objects.get(key="holder").state == EntryState.SUCCEEDED
    # The pass is asked for again at once.
    assert any(set(pools) & {"p", "q"} for pools, _ in recorder.wakes)


def test_after_commit__requeue_of_an_unpublished_entry_leaves_a_started_one_alone(
    recorder: RecordingBridge, admission_path: str
) -> None:
    from pools.core import leases

    make_pool("p", 1)
    submit("p", key="a")
    adm: Admission = recorder.admissions[0]
    assert leases.start(adm.entry_id, adm.token, worker="w") is not None
    assert not admission.requeue(adm.entry_id, adm.token, reason="x", unstarted=True)
    assert QueueEntry.objects.get(key="a").state == EntryState.RUNNING
    dispatch._scheduled.clear()


@pytest.mark.postgres
def test_schema_behind__a_missing_stored_function_is_unavailable_naming_migrate() -> None:
    """Code deployed before ``migrate``: one line that says what to run, not a bare
    ProgrammingError (on Django's connection and on pools' own)."""
    from pools.exceptions import PoolUnavailable

    next_release = f"pools_enqueue_v{functions.VERSION + 1}"  # not created here
    for own_connection in (False, True):
        fastpath.use_own_connection(own_connection)
        try:
            with pytest.raises(PoolUnavailable, match=r"run 'manage\.py migrate'"):
                fastpath.call(next_release, [], what="pools p")
        finally:
            fastpath.use_own_connection(False)


def test_schema_check__a_migrated_database_has_nothing_pending() -> None:
    from pools import checks

    assert checks.pending_migrations() == []
    assert checks.check_schema(databases=["default"]) == []


def test_schema_check__part_of_the_squashed_migrations_applied_is_named() -> None:
    """A database that applied only some of the migrations 0.1.0 squashed: ``migrate``
    would see nothing to do, so the check (also run by ``migrate``) says what to run."""
    from django.db import connection
    from django.db.migrations.recorder import MigrationRecorder

    from pools import checks

    recorder = MigrationRecorder(connection)
    recorded = sorted(name for app, name in recorder.applied_migrations() if app == "pools")
    assert "0001_release_0_1_0" in recorded and "0018_fastpath_rates" in recorded, recorded
    try:  # the rows of a database that stopped after the old chain's 0002
        for name in recorded:
            recorder.record_unapplied("pools", name)
        recorder.record_applied("pools", "0001_initial")
        recorder.record_applied("pools", "0002_sql_fast_path")
        unfinished = checks.unfinished_squash()
        messages = checks.check_schema(databases=["default"])
    finally:  # django_migrations outlives the test (transaction=True): put it back
        recorder.record_unapplied("pools", "0001_initial")
        recorder.record_unapplied("pools", "0002_sql_fast_path")
        for name in recorded:
            recorder.record_applied("pools", name)
    assert len(unfinished) == 16 and unfinished[0] == "0003_slimmer_indexes", unfinished
    assert [m.id for m in messages] == ["pools.W051"], messages
    assert "0003_slimmer_indexes" in messages[0].msg and "bf7d954" in str(messages[0].hint)
    assert checks.unfinished_squash() == [] and checks.check_schema(databases=["default"]) == []

"""Strategy ``fair`` costs what ``priority`` costs: index probes, whatever the line length.

PostgreSQL plans of the two queries a fair pool adds (the head of the line, a key's last
round: also the subquery of the enqueue function), and the number of queries of an enqueue
and of a settle+admit with 10 and with 3,000 entries waiting across 100 keys, on both
paths. The plans are quoted in ``docs/concepts/fairness.md``.
"""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from pytest_django import DjangoAssertNumQueries

from pools.core import admission, strategies
from pools.models import Demand, Pool, QueueEntry
from pools.states import FAIR_STATES
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]

KEYS = 100
#: Queries of one enqueue that waits, and of one settle that admits the next entry, in a
#: fair pool (an ORM enqueue reads the key's last round: one more than a priority pool;
#: an ORM admission that moves the pool's round on writes it: one more, not here; on
#: PostgreSQL each ORM admission pass first takes the work owed to its lock holder: one more).
ENQUEUE_WAITING = {"sql": 1, "orm": 8}
SETTLE_AND_ADMIT = {"sql": 1, "orm": 14}


def fair_backlog(pool: Pool, count: int) -> None:
    """``count`` waiting entries over :data:`KEYS` keys, placed as enqueue places them."""
    rng = random.Random(5)
    base = timezone.now() - timedelta(hours=1)
    entries = QueueEntry.objects.bulk_create(
        QueueEntry(
            key=f"bulk-{i}",
            task_name="tests.fake",
            demand={pool.name: 1},
            enqueued_at=base + timedelta(milliseconds=i),
            fairness_key=f"tenant-{rng.randrange(KEYS)}",
        )
        for i in range(count)
    )
    rounds: dict[str, int] = {}
    rows = []
    for e in entries:
        rounds[e.fairness_key] = rounds.get(e.fairness_key, pool.fair_round) + 1
        rows.append(
            Demand(
                entry=e,
                pool=pool,
                slots=1,
                enqueued_at=e.enqueued_at,
                line_round=rounds[e.fairness_key],
                line_at=e.enqueued_at,
                fairness_key=e.fairness_key,
            )
        )
    Demand.objects.bulk_create(rows)
    with connection.cursor() as cur:
        cur.execute("ANALYZE pools_demand")
        cur.execute("ANALYZE pools_queueentry")


def test_fair__head_and_key_round_are_index_probes(recorder: RecordingBridge) -> None:
    pool = make_pool("p", 1, strategy="fair")
    submit("p", key="run", fairness_key="tenant-1")
    fair_backlog(pool, 3000)
    head = str(Demand.objects.line(pool.pk).select_related("entry")[:1].explain())
    assert "pools_demand_line" in head and "Sort" not in head, head
    probe = (
        Demand.objects.filter(pool_id=pool.pk, fairness_key="tenant-7", state__in=FAIR_STATES)
        .order_by("-line_round")
        .values_list("line_round", flat=True)[:1]
    )
    plan = str(probe.explain())
    assert "pools_demand_fair_key" in plan and "Sort" not in plan, plan
    # The subquery of the enqueue function, as the function runs it.
    with connection.cursor() as cur:
        cur.execute(
            "EXPLAIN SELECT k.line_round FROM pools_demand k "
            "WHERE k.pool_id = %s AND k.fairness_key = %s "
            "AND k.state IN ('waiting', 'admitted', 'running', 'succeeded', 'failed', 'retried') "
            "ORDER BY k.line_round DESC LIMIT 1",
            [pool.pk, "tenant-7"],
        )
        sql_plan = "\n".join(r[0] for r in cur.fetchall())
    assert "pools_demand_fair_key" in sql_plan and "Sort" not in sql_plan, sql_plan
    assert strategies.next_round(pool, "tenant-7") > 1


@pytest.mark.parametrize("waiting", [10, 3000])
def test_fair__enqueue_and_settle_cost_do_not_depend_on_line_length(
    recorder: RecordingBridge,
    admission_path: str,
    waiting: int,
    django_assert_num_queries: DjangoAssertNumQueries,
) -> None:
    pool = make_pool("p", 1, strategy="fair")
    submit("p", key="run", fairness_key="tenant-1")
    fair_backlog(pool, waiting)
    with django_assert_num_queries(ENQUEUE_WAITING[admission_path]):
        assert not submit("p", key="one-more", fairness_key="tenant-3").admitted
    run = [a for a in recorder.admissions if a.key == "run"][-1]
    with django_assert_num_queries(SETTLE_AND_ADMIT[admission_path]):
        assert admission.settle(run.entry_id, run.token, "succeeded")
    assert len([a for a in recorder.admissions if a.key != "run"]) == 1

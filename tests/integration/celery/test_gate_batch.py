"""The admitted messages of one pass go out on one producer, in one round trip where the
transport batches publishes (kombu's ``Producer.batch``: Redis), and a failed batch
requeues its entries.

With ``CELERY_BROKER_URL`` on Redis (the PostgreSQL tier) the batch path runs; on the
in-memory broker the messages go out one by one, and the same assertions hold.
"""

from __future__ import annotations

from unittest import mock

import pytest

from pools.core import admission
from pools.models import Pool, QueueEntry
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.factories import make_pool
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)


POOL = "warehouse"  # the pool of tests.testapp.tasks.add


def _three_waiting(pool: str = POOL) -> list[QueueEntry]:
    make_pool(pool, 3, paused=True)
    for i in range(3):
        add.delay(i, i)
    entries = list(QueueEntry.objects.filter(demand__has_key=pool).order_by("queue_id"))
    assert [e.state for e in entries] == [EntryState.WAITING] * 3
    Pool.objects.filter(name=pool).update(paused=False)
    return entries


def _is_redis() -> bool:
    from tests.celery_app import app

    return app.connection_for_write().transport_cls in {"redis", "rediss"}


def test_publish__one_pass_one_round_trip(broker):
    entries = _three_waiting()
    flushes = []
    if _is_redis():
        from kombu.transport.redis import PublishBatch  # type: ignore[attr-defined]

        real = PublishBatch.flush

        def counted(self):
            flushes.append(self._buffered)
            return real(self)

        with mock.patch.object(PublishBatch, "flush", counted):
            admitted = admission.admit([POOL])
        assert flushes == [3], "the three messages went out in one pipeline"
    else:
        admitted = admission.admit([POOL])
    assert len(admitted) == 3
    claims = sorted(h["pools_claim"] for h in broker.drain())
    assert claims == sorted(f"{e.queue_id}:1" for e in entries)


def test_publish__a_failed_batch_requeues_every_entry_of_it(broker):
    """On Redis the pipeline's round trip fails; elsewhere each publish fails."""
    _three_waiting()

    def boom(*args, **kwargs):
        raise ConnectionError("broker gone")

    if _is_redis():
        from kombu.transport.redis import PublishBatch  # type: ignore[attr-defined]

        failing = mock.patch.object(PublishBatch, "flush", boom)
    else:
        from kombu import Producer

        failing = mock.patch.object(Producer, "publish", boom)
    with failing:
        admission.admit([POOL])
    entries = QueueEntry.objects.filter(demand__has_key=POOL)
    assert {e.state for e in entries} == {EntryState.WAITING}
    assert all(e.reason.startswith("publish failed") for e in entries)
    assert Pool.objects.get(name=POOL).held == 0
    assert broker.drain() == []

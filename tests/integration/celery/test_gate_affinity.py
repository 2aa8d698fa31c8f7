"""Node affinity on the publish side: a pinned call is held for its worker's direct queue."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pools.celery import messages
from pools.core import admission, explain, nodes
from pools.exceptions import PoolConfigurationError
from pools.models import QueueEntry
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)


def _worker_direct(on: bool) -> Iterator[None]:
    app = add.app  # the app the call goes through (another test may have made its own current)
    before = app.conf.worker_direct
    app.conf.worker_direct = on
    yield
    app.conf.worker_direct = before


@pytest.fixture
def worker_direct() -> Iterator[None]:
    """Celery's ``worker_direct`` on for the test (the test settings turn it on too)."""
    yield from _worker_direct(True)


@pytest.fixture
def no_worker_direct() -> Iterator[None]:
    """Celery's ``worker_direct`` off for the test."""
    yield from _worker_direct(False)


@pytest.mark.usefixtures("worker_direct")
def test_pinned_call__held_for_the_direct_queue_and_waits_for_its_worker(
    recorder: RecordingBridge,
) -> None:
    make_pool("warehouse", 2)
    result = add.apply_async((1, 2), pool_options={"worker": "w1@host"})  # type: ignore[call-arg]
    entry = QueueEntry.objects.get(key=result.id)
    assert (entry.state, entry.pinned_worker) == (EntryState.WAITING, "w1@host")
    held = messages.held_in(entry.options)
    assert held is not None
    # Celery routes a call to the worker's direct queue (``w1@host.dq2``) by its name.
    assert (held.exchange, held.routing_key, held.declare) == ("", "w1@host.dq2", [])
    assert explain.explain(entry).blocked_by == "worker_unavailable"
    behind = add.delay(3, 4)  # unpinned, but behind the pinned head of its pool
    assert QueueEntry.objects.get(key=behind.id).state == EntryState.WAITING
    nodes.beat("w1@host")
    admission.admit(["warehouse"])
    assert recorder.keys() == [result.id, behind.id]


@pytest.mark.usefixtures("no_worker_direct")
def test_pinned_call__refused_without_worker_direct(recorder: RecordingBridge) -> None:
    make_pool("warehouse", 1)
    with pytest.raises(PoolConfigurationError, match="worker_direct"):
        add.apply_async((1, 2), pool_options={"worker": "w1@host"})  # type: ignore[call-arg]
    assert not QueueEntry.objects.exists()


@pytest.mark.usefixtures("worker_direct")
def test_pinned_call__a_bad_hostname_is_refused_at_the_call(recorder: RecordingBridge) -> None:
    make_pool("warehouse", 1)
    with pytest.raises(PoolConfigurationError, match="worker hostname"):
        add.apply_async((1, 2), pool_options={"worker": "w1"})  # type: ignore[call-arg]

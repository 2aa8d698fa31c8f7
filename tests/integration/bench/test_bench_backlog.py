"""The benchmark's bulk copies of an entry take their place in line by the pool's strategy."""

from __future__ import annotations

import pytest

from pools.bench import bulk_copy
from pools.models import Demand, Pool, QueueEntry
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True)


def line(pool: str) -> list[int]:
    """Priorities of the waiting entries of ``pool``, in line order."""
    pid = Pool.objects.get(name=pool).pk
    return [d.entry.priority for d in Demand.objects.line(pid).select_related("entry")]


@pytest.mark.parametrize("strategy", ["priority", "fifo"])
def test_copy_entries__copies_are_placed_by_the_pools_strategy(
    recorder: RecordingBridge, strategy: str
) -> None:
    make_pool("p", 1, paused=True, strategy=strategy)
    template = submit("p", key="t", priority=0)
    bulk_copy.copy_entries(template.key, range(3), lambda j: [j], lambda j: [10, 0, 5][j])
    assert QueueEntry.objects.count() == 4
    if strategy == "priority":
        assert line("p") == [10, 5, 0, 0]  # by priority, then first come (the template)
    else:
        assert line("p") == [0, 10, 0, 5]  # first come: the template, then the copies

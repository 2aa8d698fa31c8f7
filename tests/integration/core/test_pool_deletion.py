"""Deleting a pool takes what is kept about it without a foreign key: owed work."""

from __future__ import annotations

import pytest

from pools.core import pool_crud
from pools.models import OwedWork, Pool
from tests.conftest import POOL_APPS
from tests.support.factories import make_pool

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)


def test_delete_pool__takes_its_owed_work_and_leaves_other_pools_owed_work() -> None:
    """Owed-work rows (pools_owedwork) have no foreign key to the pool: a deleted pool's
    would otherwise stay for ever, and another pool's must stay."""
    gone = make_pool("owed-gone", 2)
    kept = make_pool("owed-kept", 2)
    OwedWork.objects.create(pool_id=gone.pk, slot=0, slots=1, pending=True)
    OwedWork.objects.create(pool_id=gone.pk, slot=1, slots=0, pending=True)
    OwedWork.objects.create(pool_id=kept.pk, slot=0, slots=1, pending=True)

    assert pool_crud.delete_pool("owed-gone") is True

    assert not Pool.objects.filter(name="owed-gone").exists()
    assert not OwedWork.objects.filter(pool_id=gone.pk).exists()
    assert list(OwedWork.objects.values_list("pool_id", "slots")) == [(kept.pk, 1)]

"""Deleting a pool takes what is kept about it without a foreign key: owed work."""

from __future__ import annotations

import pytest

from pools.core import pool_crud
from pools.models import OwedRelease, Pool
from tests.conftest import POOL_APPS
from tests.support.factories import make_pool

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)


def test_delete_pool__takes_its_owed_work_and_leaves_other_pools_owed_work() -> None:
    """Owed rows (pools_owedrelease) have no foreign key to the pool: a deleted pool's
    would otherwise stay for ever, and another pool's must stay."""
    gone = make_pool("owed-gone", 2)
    kept = make_pool("owed-kept", 2)
    OwedRelease.objects.create(pool_id=gone.pk, slots=1)
    OwedRelease.objects.create(pool_id=gone.pk, slots=0)
    OwedRelease.objects.create(pool_id=kept.pk, slots=1)

    assert pool_crud.delete_pool("owed-gone") is True

    assert not Pool.objects.filter(name="owed-gone").exists()
    assert not OwedRelease.objects.filter(pool_id=gone.pk).exists()
    assert list(OwedRelease.objects.values_list("pool_id", "slots")) == [(kept.pk, 1)]

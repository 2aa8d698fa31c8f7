"""Former home of the pool definition services, now in modules of one job each:
:mod:`pools.core.declarations` (settings parsing), :mod:`pools.core.settings_sync`,
:mod:`pools.core.capacity` (capacity and pause), :mod:`pools.core.pool_crud` and
:mod:`pools.core.per_key` (pools made on first use).

The names below stay here for the modules that still import them from this one.
"""

from __future__ import annotations

from pools.core.declarations import default_pool
from pools.core.per_key import ensure_cap_pool, ensure_pool
from pools.core.pool_crud import update_pool

__all__ = ["default_pool", "ensure_cap_pool", "ensure_pool", "update_pool"]

"""A web process's view under ``ATOMIC_REQUESTS``, for ``test_enqueue_in_transaction.py``.

``python -m tests.acceptance.txn_holder HOLD``: inside ``transaction.atomic()``, call
the pooled task ``span`` (prints ``enqueued <task id>``), then hold the transaction open
until a line arrives on stdin and at least ``HOLD`` seconds have passed (the view's
other work); ``commit`` commits, anything else rolls back. Prints ``committed`` or
``rolled back`` (``committed`` with the time of the commit). ``POOLS_TEST_LOCKED_ENQUEUE=1``
takes the pool lock inside the transaction as before (the sabotage twin); ``=fk`` (MariaDB)
lets InnoDB check the line rows' foreign keys at the insert.
"""

from __future__ import annotations

import os
import sys
import time

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from django.db import transaction  # noqa: E402

from tests.celery_app import app  # noqa: E402, F401  (the app the workers run)
from tests.testapp.tasks import span  # noqa: E402


class _Rollback(Exception):
    pass


def main(hold: float) -> None:
    sabotage = os.environ.get("POOLS_TEST_LOCKED_ENQUEUE")
    if sabotage == "1":
        from pools.core import admission

        admission.in_callers_transaction = lambda: False
    elif sabotage == "fk":
        from contextlib import nullcontext

        from pools.core import in_transaction

        in_transaction.parent_rows_unlocked = nullcontext  # type: ignore[assignment]
    try:
        committed_at: list[float] = []
        with transaction.atomic():
            # Runs first after the commit, before the enqueue's own after-commit admission.
            transaction.on_commit(lambda: committed_at.append(time.time()))
            result = span.delay(-1, 0.03)
            print("enqueued", result.id, flush=True)
            began = time.monotonic()
            command = sys.stdin.readline().strip()
            time.sleep(max(0.0, hold - (time.monotonic() - began)))
            if command != "commit":
                raise _Rollback
    except _Rollback:
        print("rolled back", flush=True)
    else:
        print("committed", committed_at[0], flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]))

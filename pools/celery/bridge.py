"""The Celery bridge: publishes admitted entries, reports entries that ended waiting.

The core calls the bridge named by ``POOLS["PUBLISHER"]`` (:mod:`pools.core.dispatch`);
:data:`bridge` is the default. It publishes each held message with the same task id and a
``pools_claim`` header (``"<entry id>:<fencing token>"``), around the gate.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from celery import Celery, current_app
from django.utils import timezone

from pools.celery import messages, originals, results
from pools.celery.messages import BUDGET_HEADER, CLAIM_HEADER, DEBOUNCED_HEADER, RATED_HEADER
from pools.core import admission
from pools.core.records import BUDGET_OPTION, DEBOUNCED_OPTION, Admission, Finished

#: The gate's logger, named as before the gate was split.
logger = logging.getLogger("pools.celery.gate")


class CeleryBridge:
    """Publishes admitted entries and reports entries that ended while waiting."""

    def publish(self, admissions: Sequence[Admission]) -> None:
        """Publish each held message with its claim header; requeue on broker failure.

        One producer (and its connection) for the whole pass; on a transport that batches
        publishes (kombu's ``Producer.batch``: Redis) the messages of one pass go out in one
        round trip. Where a batch fails as a whole, every entry of it is requeued: a message
        that did reach the broker then carries a stale token and is skipped at delivery.
        """
        if not admissions:
            return
        now = timezone.now()
        with current_app.producer_or_acquire(None) as producer:
            batch = getattr(producer, "batch", None)
            if batch is None or len(admissions) == 1:
                for adm in admissions:
                    try:
                        self._publish_one(current_app, producer, adm, now)
                    except Exception as exc:
                        self._publish_failed(adm, exc)
                return
            sent: list[Admission] = []
            try:
                with batch():
                    for adm in admissions:
                        try:
                            self._publish_one(current_app, producer, adm, now)
                        except Exception as exc:  # this message only (e.g. its routing)
                            self._publish_failed(adm, exc)
                        else:
                            sent.append(adm)
            except Exception as exc:  # the batch's round trip failed
                for adm in sent:
                    self._publish_failed(adm, exc)

    def _publish_one(self, app: Celery, producer: Any, adm: Admission, now: datetime) -> None:
        claim: dict[str, Any] = {CLAIM_HEADER: f"{adm.entry_id}:{adm.token}"}
        if adm.options.get(BUDGET_OPTION):
            claim[BUDGET_HEADER] = adm.options[BUDGET_OPTION]
        if adm.rated:
            claim[RATED_HEADER] = 1
        if adm.options.get(DEBOUNCED_OPTION):
            claim[DEBOUNCED_HEADER] = list(adm.options[DEBOUNCED_OPTION])
        held = messages.held_in(adm.options)
        if held is not None:
            messages.publish(producer, held, extra_headers=claim, queues=app.amqp.queues, now=now)
            return
        # An entry stored before messages were held whole: rebuild it with send_task.
        options = dict(adm.options)
        headers = {**(options.pop("headers", None) or {}), **claim}
        originals.send_task(
            app, adm.task_name, adm.args, adm.kwargs, task_id=adm.key, headers=headers, **options
        )

    def _publish_failed(self, adm: Admission, exc: Exception) -> None:
        logger.exception("Publishing admitted entry %s failed; requeueing it", adm.entry_id)
        try:
            admission.requeue(
                adm.entry_id,
                adm.token,
                reason=f"publish failed: {exc}"[:255],
                admit=False,
                unstarted=True,
            )
        except Exception:
            logger.exception("Could not requeue entry %s; its lease will lapse", adm.entry_id)

    def report_finished(self, finished: Sequence[Finished]) -> None:
        """Store a failure (expired) or revocation (cancelled) result for each entry."""
        for item in finished:
            try:
                results.report(item)
            except Exception:
                logger.exception("Could not store the result of entry %s", item.entry_id)

    def terminate(self, key: str) -> None:
        """Revoke with terminate; the worker's ``task_revoked`` settles the claim."""
        current_app.control.revoke(key, terminate=True)

    def wake_at(self, pools: Sequence[str], when: datetime) -> None:
        """Send ``pools.admit`` with a short countdown: timed admission without polling."""
        assert originals.kept(), "pools.celery.gate.install() was not called"
        delay = max(0.0, (when - timezone.now()).total_seconds())
        try:
            originals.send_task(
                current_app,
                "pools.admit",
                (list(pools),),
                countdown=delay,
                expires=delay + 60,
                ignore_result=True,
            )
        except Exception as exc:
            # The entries are safely in line: the caller's call must not fail for this, and
            # the sweep (every SWEEP_SECONDS) runs the admission the wake-up would have.
            logger.warning(
                "Timed wake-up of pools %s not sent (%s); the next sweep admits them",
                ", ".join(pools),
                exc,
            )


#: The bridge named by the default ``POOLS["PUBLISHER"]``.
bridge = CeleryBridge()

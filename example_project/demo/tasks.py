"""Pooled demo tasks. They only sleep, so the contention on their pools is easy to watch."""

import time

from celery import shared_task

from pools import current_claim, pooled


def _work(seconds: float) -> dict:
    time.sleep(seconds)
    claim = current_claim()
    return {"slept": seconds, "token": claim.token if claim else None}


@shared_task
@pooled("warehouse", slots=2, priority=10)
def export(day: str) -> dict:
    """A heavy nightly export: two warehouse slots, ahead of everything else in line."""
    return _work(3.0)


@shared_task
@pooled("warehouse")
def load_table(table: str) -> dict:
    """An ordinary warehouse load: one slot, default priority."""
    return _work(1.5)


@shared_task
@pooled({"warehouse": 1, "partner-api": 1})
def sync_partner(account_id: int) -> dict:
    """Reads the warehouse and calls the partner API: both slots are taken atomically."""
    return _work(1.5)


@shared_task
@pooled("reports", priority=5)
def render_report(report_id: int) -> dict:
    """Renders a PDF: one slot of the reports pool."""
    return _work(2.0 + (report_id % 3) * 0.5)


@shared_task
@pooled("reports")
def summarize(results: list, night: int) -> dict:
    """The end of a workflow run (a chord's body): one slot of the reports pool."""
    return {"night": night, "parts": len(results), **_work(1.0)}

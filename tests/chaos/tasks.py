"""Pooled task bodies of the chaos scenario, and their independent recorder.

Every body appends JSON lines to ``$CHAOS_DIR/bodies-<pid>.jsonl``: ``start`` (after its
claim started), a ``tick`` every :data:`TICK_SECONDS` while it runs (its signs of life) and
``end`` (in ``finally``, so a body interrupted by ``LeaseLost`` still writes it; a
SIGKILLed one does not). Each line carries the entry id, fencing token,
the pools and slots held and ``valid_until``: when the body's lease runs out as far as its
own process knows (the claim's lease at start, the keeper's latest renewal at the end).
The checker (:mod:`tests.chaos.check`) trusts nothing else: not the database, not the
result backend.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

from celery import shared_task

from pools import current_claim, pooled
from pools.celery.keeper import keeper

#: A running body writes a ``tick`` line this often.
TICK_SECONDS = 0.1
#: The scenario's pools and their capacities.
POOLS = {"chaos-a": 3, "chaos-b": 2, "chaos-c": 2}


def _record(kind: str, **fields: Any) -> None:
    where = os.environ.get("CHAOS_DIR")
    if not where:
        return
    fields.update(kind=kind, t=time.time(), pid=os.getpid())
    line = (json.dumps(fields, sort_keys=True) + "\n").encode()
    # One write(2) on an O_APPEND descriptor: lines from one process never interleave.
    fd = os.open(
        Path(where) / f"bodies-{os.getpid()}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND
    )
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _lease_end(entry_id: int, default: float) -> float:
    """The lease end this process last heard of for ``entry_id`` (renewals included)."""
    with keeper._lock:  # a test recorder may read the keeper's table
        held = keeper._held.get(entry_id)
    return held.expires_at.timestamp() if held is not None else default


def _body(kind: str, task_id: str, millis: int) -> str:
    claim = current_claim()
    assert claim is not None, "a pooled body runs with a claim"
    fields = {
        "task": kind,
        "key": task_id,
        "entry": claim.entry_id,
        "token": claim.token,
        "demand": claim.demand,
    }
    valid_until = claim.lease_expires_at.timestamp()
    _record("start", valid_until=valid_until, millis=millis, **fields)
    try:
        deadline = time.monotonic() + millis / 1000
        tick = time.monotonic() + TICK_SECONDS
        while time.monotonic() < deadline:  # small steps: LeaseLost arrives between bytecodes
            time.sleep(0.01)
            if time.monotonic() >= tick:
                _record("tick", **fields)
                tick += TICK_SECONDS
    finally:
        _record("end", valid_until=_lease_end(claim.entry_id, valid_until), **fields)
    return kind


@shared_task(bind=True, name="chaos.single_a", acks_late=True)
@pooled("chaos-a")
def single_a(self: Any, millis: int) -> str:
    return _body("single_a", self.request.id, millis)


@shared_task(bind=True, name="chaos.single_b", acks_late=True)
@pooled("chaos-b")
def single_b(self: Any, millis: int) -> str:
    return _body("single_b", self.request.id, millis)


@shared_task(bind=True, name="chaos.multi_ac", acks_late=True)
@pooled({"chaos-a": 1, "chaos-c": 2})
def multi_ac(self: Any, millis: int) -> str:
    return _body("multi_ac", self.request.id, millis)


@shared_task(bind=True, name="chaos.retrying_c", acks_late=True, max_retries=3)
@pooled("chaos-c")
def retrying_c(self: Any, millis: int) -> str:
    """Fails its first attempt and retries once (a new entry for the same task id)."""
    result = _body("retrying_c", self.request.id, millis)
    if self.request.retries == 0:
        raise self.retry(countdown=0.1)
    return result


@shared_task(bind=True, name="chaos.typed_b", acks_late=True)
@pooled("chaos-b")
def typed_b(self: Any, millis: int, values: list[Any], *, when: Any, tags: Any) -> Any:
    """Arguments of every kind kombu's JSON carries typed; returns them as it got them.

    The runner compares each result with what it sent (:func:`tests.chaos.check.typed_mismatches`):
    a call that waited in line must come back with the same values, and it must run at all
    (an entry whose arguments broke admission stalls its pool: the drain then fails).
    """
    _body("typed_b", self.request.id, millis)
    return {"values": values, "when": when, "tags": tags}


def typed_arguments(rng: random.Random) -> tuple[list[Any], dict[str, Any]]:
    """Positional values and keyword arguments of one ``chaos.typed_b`` call (after
    ``millis``): date, datetimes with and without a time zone, UUID, Decimal and bytes, at
    the top level and nested in lists and dicts, in args and in kwargs."""
    day = rng.randint(1, 28)
    stamp = datetime(2026, 12, day, rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59))
    ident = uuid.UUID(int=rng.getrandbits(128))
    amount = Decimal(f"{rng.randint(0, 10**6)}.{rng.randint(0, 99):02d}")
    raw = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 12)))
    values = [
        date(2026, 12, day),
        stamp.replace(tzinfo=UTC),
        stamp,  # naive
        ident,
        amount,
        raw,
        [date(2027, 1, day), {"id": ident, "raw": raw, "at": [stamp, stamp.replace(tzinfo=UTC)]}],
    ]
    kwargs = {
        "when": stamp.replace(tzinfo=timezone(timedelta(hours=5, minutes=30))),
        "tags": {"amount": amount, "ids": [ident, uuid.UUID(int=rng.getrandbits(128))],
                 "day": date(2026, 11, day), "blob": {"raw": raw}},
    }  # fmt: skip
    return values, kwargs


def typed_result(values: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What ``chaos.typed_b`` returns for these arguments on plain Celery."""
    return {"values": values, **kwargs}

"""The common recipe, written fairly: a Redis counting semaphore with a TTL, taken in the body.

This is what Celery users write today to cap concurrency across workers::

    @shared_task(bind=True, max_retries=None)
    def task(self, ...):
        if not semaphore.acquire(self.request.id):
            raise self.retry(countdown=0.05)      # full: come back in 50 ms
        try:
            ...                                   # the body
        finally:
            semaphore.release(self.request.id)

The semaphore is the sound version of it: one sorted set per limit, acquire and expiry in one
Lua script using Redis's own clock (atomic, no client clock skew), members keyed by task id so
a retry of the same task cannot hold two slots, a TTL so a killed holder cannot keep its slot
forever (the recipe's only recovery, and it must exceed the longest run of the task because
nothing renews it). The retry countdown is short (50 ms), so the recipe is not handicapped
by long waits; priorities are Celery message priorities (Redis: 0 is served first).

For the benchmark's count of priority inversions the acquire script also numbers each
successful acquisition (a counter bumped in the same script: no extra round trip).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from celery import Task, shared_task

from pools.bench.bodies import span

#: Retry countdown of the recipe when the semaphore is full (seconds).
COUNTDOWN = 0.05

#: Seconds the acquisition counter of a semaphore is kept after its last use.
SEQUENCE_KEEP = 3600

# KEYS: the holders (sorted set), the acquisition counter.
# ARGV: limit, ttl, token, seconds to keep the holders, seconds to keep the counter.
# Returns 0 when full, else the acquisition's number: one counter, bumped in the same atomic
# script, so the numbers give the order in which acquisitions succeeded (no clocks involved).
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now, ARGV[3])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
  local n = redis.call('INCR', KEYS[2])
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[5]))
  return n
end
return 0
"""

_clients: dict[tuple[int, str], Any] = {}


def _client(url: str) -> Any:
    """One Redis client per process (prefork children fork after import)."""
    key = (os.getpid(), url)
    client = _clients.get(key)
    if client is None:
        import redis

        client = _clients[key] = redis.Redis.from_url(url)
    return client


class Semaphore:
    """At most ``limit`` holders of ``key`` at once; a holder's slot lapses after ``ttl`` s."""

    def __init__(self, url: str, key: str, limit: int, ttl: float) -> None:
        self.url, self.key, self.limit, self.ttl = url, key, limit, ttl

    @property
    def sequence_key(self) -> str:
        """The counter numbering successful acquisitions (see :meth:`mark`)."""
        return sequence_key(self.key)

    def acquire(self, token: str) -> int:
        """Take a slot for ``token`` if one is free (expired holders are dropped first).

        Returns 0 if the semaphore is full, else the number of this acquisition (1, 2, ...).
        """
        client = _client(self.url)
        keep = math.ceil(self.ttl) + 1
        keys = (self.key, self.sequence_key)
        args = (self.limit, self.ttl, token, keep, keep + SEQUENCE_KEEP)
        return int(client.eval(_ACQUIRE, 2, *keys, *args))

    def mark(self) -> int:
        """Bump the acquisition counter from outside: every later acquisition has a larger number.

        The benchmark marks the moment its backlog is fully submitted, on the same counter.
        """
        client = _client(self.url)
        pipe = client.pipeline()
        pipe.incr(self.sequence_key)
        pipe.expire(self.sequence_key, math.ceil(self.ttl) + 1 + SEQUENCE_KEEP)
        return int(pipe.execute()[0])

    def release(self, token: str) -> None:
        """Give the slot of ``token`` back."""
        _client(self.url).zrem(self.key, token)

    def holders(self) -> int:
        """Current holders (expired ones included until the next acquire drops them)."""
        return int(_client(self.url).zcard(self.key))

    def delete(self) -> None:
        """Remove the semaphore's keys."""
        _client(self.url).delete(self.key, self.sequence_key)


def sequence_key(key: str) -> str:
    """The acquisition counter of the semaphore ``key``."""
    return f"{key}:acquired"


@shared_task(bind=True, name="pools.bench.recipe", max_retries=None)
def limited(
    self: Task,
    i: int,
    sleep: float,
    url: str,
    key: str,
    limit: int,
    ttl: float,
    hold: float = 0.0,
) -> dict[str, Any]:
    """A body limited by the recipe: take the semaphore or retry in :data:`COUNTDOWN` s."""
    sem = Semaphore(url, key, limit, ttl)
    token = self.request.id or ""
    number = sem.acquire(token)
    if not number:
        raise self.retry(countdown=COUNTDOWN)
    acquired = time.time()
    try:
        if hold > 0:  # kill test: say where we are, then hold the slot until SIGKILLed
            self.update_state(state="HOLDING", meta={"pid": os.getpid(), "at": acquired})
            time.sleep(hold)
        result = span(i, sleep, retries=self.request.retries or 0)
    finally:
        sem.release(token)
    result["a"] = acquired  # when (this process's clock) ...
    result["n"] = number  # ... and in which order (the semaphore's counter) it acquired
    return result

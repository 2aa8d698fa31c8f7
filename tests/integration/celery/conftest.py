"""Fixtures of the Celery glue's in-process tests."""

from __future__ import annotations

from typing import Any, cast

import pytest
from kombu.transport.virtual import Channel as VirtualChannel


class Broker:
    """The messages really on the (in-memory) broker, read back from the default queue."""

    def __init__(self) -> None:
        from tests.celery_app import app

        self.app = app
        self.seen: list[dict[str, Any]] = []

    def drain(self) -> list[dict[str, Any]]:
        with self.app.connection_for_read() as conn:
            # A kombu virtual channel (memory transport): basic_get is not on StdChannel.
            channel = cast(VirtualChannel, conn.default_channel)
            while (message := channel.basic_get("celery", no_ack=True)) is not None:
                self.seen.append(dict(message.headers or {}))
        return self.seen


@pytest.fixture
def broker() -> Broker:
    """What the gate really publishes (empty at the start of the test)."""
    b = Broker()
    b.drain()
    b.seen.clear()
    return b

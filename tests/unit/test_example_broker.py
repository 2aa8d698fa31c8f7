"""The example project's embedded broker: kombu's filesystem transport with whole-file writes."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from kombu import Connection

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "example_project"))
from example_project import broker


def channel_of(conn: Connection) -> broker.Channel:
    """The example broker's channel of ``conn``."""
    channel = conn.default_channel
    assert isinstance(channel, broker.Channel)
    return channel


@pytest.fixture
def connection(tmp_path: Path) -> Iterator[tuple[Connection, Path]]:
    folders = {name: tmp_path / name for name in ("queue", "processed", "control")}
    for folder in folders.values():
        folder.mkdir()
    options = {
        "data_folder_in": str(folders["queue"]),
        "data_folder_out": str(folders["queue"]),
        "processed_folder": str(folders["processed"]),
        "control_folder": str(folders["control"]),
    }
    with Connection(
        "filesystem://", transport="example_project.broker:Transport", transport_options=options
    ) as conn:
        yield conn, folders["queue"]


def test_put__leaves_only_whole_message_files(connection: tuple[Connection, Path]) -> None:
    conn, folder = connection
    channel = conn.default_channel
    assert isinstance(channel, broker.Channel)

    channel._put("jobs", {"body": "x" * 10_000})

    (written,) = folder.iterdir()
    assert written.name.endswith(".jobs.msg")
    assert channel._get("jobs") == {"body": "x" * 10_000}


def test_get__skips_a_file_still_being_written(connection: tuple[Connection, Path]) -> None:
    conn, folder = connection
    channel = channel_of(conn)
    # What a producer leaves while it writes: an incomplete file under the hidden name.
    (folder / f"1_abc.jobs.msg{broker.PARTIAL}").write_bytes(b'{"body": "hal')

    with pytest.raises(Empty):
        channel._get("jobs")
    assert channel._size("jobs") == 0


def test_concurrent_producer_and_consumer__every_message_arrives_whole(
    connection: tuple[Connection, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow encoder widens the window in which a message file exists but is not written.

    kombu's own channel creates the file before it encodes and writes the message, so a
    reader in that window gets an empty file (a JSONDecodeError that stops a worker).
    """
    from kombu.transport import filesystem
    from kombu.utils.json import dumps

    def slow_dumps(payload: Any) -> str:
        time.sleep(0.002)
        return dumps(payload)

    monkeypatch.setattr(filesystem, "dumps", slow_dumps)
    monkeypatch.setattr(broker, "dumps", slow_dumps)
    conn, _folder = connection
    count = 200
    received: list[int] = []

    def produce() -> None:
        with conn.clone() as other:
            for i in range(count):
                channel_of(other)._put("jobs", {"i": i, "pad": "y" * 2000})

    producer = threading.Thread(target=produce)
    producer.start()
    channel = channel_of(conn)
    while len(received) < count:
        try:
            received.append(channel._get("jobs")["i"])
        except Empty:
            if not producer.is_alive() and channel._size("jobs") == 0:
                break
    producer.join()
    assert sorted(received) == list(range(count))

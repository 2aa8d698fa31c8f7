"""The embedded broker: kombu's ``filesystem://`` transport, with whole-file message writes.

kombu's filesystem channel creates a message file and then writes into it; a worker polling
the folder at that moment can pick up the still-empty file, fail to decode it and stop
(kombu issue #1551). This channel writes each message under a name the readers skip and
renames it into place when it is complete (``os.replace`` is atomic on one file system), so
a reader sees either no message or all of it. Selected in ``settings.py`` with
``CELERY_BROKER_TRANSPORT`` when the broker URL is ``filesystem://``.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps

#: Readers only take files named ``<stamp>_<id>.<queue>.msg``: this suffix hides a file
#: that is still being written.
PARTIAL = ".part"


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Put a message on ``queue``: write it aside, then rename it into the queue."""
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = final + PARTIAL
        try:
            with open(partial, "wb") as out:
                out.write(dumps(payload).encode())
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel

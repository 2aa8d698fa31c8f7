"""A web process of one release: submits pooled calls at a steady pace (``tests.upgrade.run``).

Run as a script with the release's tree first on ``PYTHONPATH``, so it is that release's
code that enqueues. Writes one JSON line per call to the output file: the task id, or the
exception the call raised. Usage: ``python submit.py OUT COUNT INTERVAL SLEEP TAG``.
"""

from __future__ import annotations

import json
import sys
import time

import django


def main() -> None:
    out, count, interval, sleep, tag = sys.argv[1:6]
    django.setup()
    from tests.testapp.tasks import record

    with open(out, "a") as lines:
        for i in range(int(count)):
            started = time.time()
            try:
                result = record.apply_async((i, float(sleep)))
                line = {"tag": tag, "i": i, "id": result.id, "at": started}
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                line = {
                    "tag": tag,
                    "i": i,
                    "error": f"{type(exc).__name__}: {first}",
                    "at": started,
                }
            lines.write(json.dumps(line) + "\n")
            lines.flush()
            time.sleep(max(0.0, float(interval) - (time.time() - started)))


if __name__ == "__main__":
    main()

"""The names of the stored functions of the PostgreSQL fast path.

Every function of ``pools/pg/sql/schema.sql`` is named ``pools_<name>_v<VERSION>``. The
suffix changes when a release changes a function's arguments or results: the release then
creates the new names beside the old ones (expand), its code calls the new ones, and the
next release drops the old ones (contract), so the previous release's processes keep
working while a deploy migrates (docs/howto/upgrading.md, docs/howto/sql-changes.md).
"""

from __future__ import annotations

#: The version suffix of the functions this code calls (``_v8``).
VERSION = 8

#: The functions, by their name without prefix and suffix.
BASES = (
    "admit",
    "enqueue",
    "enqueue_call",
    "enqueued",
    "finish",
    "line",
    "out",
    "owe",
    "recheck",
    "settle",
    "settle_call",
    "settled",
    "start",
    "start_rated",
)


def name(base: str) -> str:
    """The SQL name of a stored function: ``name("admit") == "pools_admit_v8"``."""
    if base not in BASES:
        raise ValueError(f"no stored function {base!r}: one of {', '.join(BASES)}")
    return f"pools_{base}_v{VERSION}"

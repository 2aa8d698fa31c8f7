"""Pool policies in admission: fast-path functions version 5 and an index on jobs.

Version 5 of the stored functions (``pools/pg/sql/admission_v5.sql``) hands draining pools,
heads that may be ineligible (``forbid`` with a job, pinned to a worker) and enqueues that
a pool policy decides (paused with ``reject``, draining, a full backlog that drops an
entry) to the Python pass. The index finds the held instances of a job (``forbid``).
Going back re-creates version 4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.db import migrations, models

SQL_DIR = Path(__file__).resolve().parent.parent / "pg" / "sql"
SQL_V5 = SQL_DIR / "admission_v5.sql"
SQL_V4 = SQL_DIR / "admission_v4.sql"
DROP_V4 = """
DROP FUNCTION IF EXISTS pools_enqueue_v4(
    text, text, jsonb, jsonb, jsonb, jsonb, integer, timestamptz, timestamptz, timestamptz,
    text, text, text, integer, double precision, boolean, integer
);
DROP FUNCTION IF EXISTS pools_start_v4(
    bigint, bigint, text, timestamptz, double precision, boolean, integer
);
DROP FUNCTION IF EXISTS pools_settle_v4(
    bigint, bigint, text, text, boolean, timestamptz, double precision, boolean, integer
);
DROP FUNCTION IF EXISTS pools_admit_v4(bigint[], timestamptz, double precision, boolean);
DROP FUNCTION IF EXISTS pools_out_v4(
    text, bigint, text, bigint, text, text, jsonb, jsonb, jsonb, jsonb, text, text, bigint,
    bigint, timestamptz, bigint, text, jsonb
);
"""
DROP_V5 = DROP_V4.replace("_v4", "_v5")


def _swap(create: Path, drop: str) -> Any:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            with schema_editor.connection.cursor() as cursor:
                cursor.execute(create.read_text())
                cursor.execute(drop)

    return run


class Migration(migrations.Migration):
    dependencies = [("pools", "0010_policies_schema")]

    operations = [
        migrations.AddIndex(
            model_name="queueentry",
            index=models.Index(
                fields=["job"],
                name="pools_entry_job",
                condition=models.Q(job__gt="", finished_at__isnull=True),
            ),
        ),
        migrations.RunPython(_swap(SQL_V5, DROP_V4), _swap(SQL_V4, DROP_V5)),
    ]

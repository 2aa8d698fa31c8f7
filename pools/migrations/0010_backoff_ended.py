"""A pool paused by a backoff that has ended is handed to the Python pass by the stored
functions (a 'fallback' pool), which resumes it (PostgreSQL; docs/howto/backoff.md)."""

from django.db import migrations

from pools.pg import sqlfile


class Migration(migrations.Migration):
    dependencies = [("pools", "0009_owed_work")]
    operations = [
        sqlfile.run("deltas/0.2.0_backoff_ended.sql", reverse="deltas/0.2.0_owed_slots.sql")
    ]

"""The start of an entry admitted in a pool with a rate as one stored function on
PostgreSQL (pools_start_rated, docs/howto/rate-limits.md#exactness)."""

from django.db import migrations

from pools.pg import sqlfile


class Migration(migrations.Migration):
    dependencies = [("pools", "0010_backoff_ended")]
    operations = [sqlfile.run("deltas/0.2.0_rated_start.sql")]

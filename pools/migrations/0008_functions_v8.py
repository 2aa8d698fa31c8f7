"""Stored functions version 8 (PostgreSQL): a call that finds its pool locked leaves its
work to the lock holder (docs/concepts/admission.md#contention)."""

from django.db import migrations

from pools.pg import sqlfile


class Migration(migrations.Migration):
    dependencies = [("pools", "0007_owed_release")]
    operations = [sqlfile.run("deltas/0.2.0_contention.sql")]

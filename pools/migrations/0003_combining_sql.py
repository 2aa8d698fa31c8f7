"""Stored functions version 8: settles combine under contention (docs/concepts/contention.md)."""

from django.db import migrations

from pools.pg import sqlfile


class Migration(migrations.Migration):
    dependencies = [("pools", "0002_demand_releasing")]
    operations = [sqlfile.run("deltas/0.2.0_combining.sql")]

from django.db import migrations

from pools.pg import sqlfile


class Migration(migrations.Migration):
    dependencies = [("pools", "0003_debounce_key")]
    operations = [sqlfile.run("deltas/0.2.0_fenced_start.sql")]

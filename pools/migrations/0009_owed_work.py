"""Owed work in place (PostgreSQL contention, docs/concepts/admission.md#contention): a
pool's owed work lives in at most 16 rows of ``pools_owedwork`` that calls update in
place, instead of a row of ``pools_owedrelease`` inserted per call and deleted by the lock
holder (whose dead index entries slowed every look for owed work until a vacuum). Releases
still owed move to the new table; the stored functions' bodies follow (delta)."""

import django.db.models.deletion
from django.db import migrations, models
from django.db.models import Sum

from pools.pg import sqlfile


def move_owed(apps, schema_editor):  # type: ignore[no-untyped-def]
    """Releases still owed in the old table, one pending row per pool."""
    old = apps.get_model("pools", "OwedRelease")
    new = apps.get_model("pools", "OwedWork")
    db = schema_editor.connection.alias
    owed = old.objects.using(db).values("pool_id").annotate(n=Sum("slots")).order_by()
    new.objects.using(db).bulk_create(
        [new(pool_id=o["pool_id"], slot=0, slots=o["n"], pending=True) for o in owed]
    )


def room_for_updates_in_place(apps, schema_editor):  # type: ignore[no-untyped-def]
    """Half of each page free, so that an update stays on its page (HOT: no index entry)."""
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE pools_owedwork SET (fillfactor = 50)")


class Migration(migrations.Migration):
    dependencies = [
        ("pools", "0008_functions_v8"),
    ]

    operations = [
        migrations.CreateModel(
            name="OwedWork",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("slot", models.PositiveSmallIntegerField()),
                ("slots", models.PositiveIntegerField(default=0)),
                ("pending", models.BooleanField(default=False)),
                (
                    "pool",
                    models.ForeignKey(
                        db_constraint=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="pools.pool",
                    ),
                ),
            ],
        ),
        migrations.AddConstraint(
            model_name="owedwork",
            constraint=models.UniqueConstraint(
                fields=("pool", "slot"), name="pools_owedwork_pool_slot"
            ),
        ),
        migrations.RunPython(move_owed, migrations.RunPython.noop),
        migrations.RunPython(room_for_updates_in_place, migrations.RunPython.noop),
        migrations.DeleteModel(
            name="OwedRelease",
        ),
        sqlfile.run("deltas/0.2.0_owed_slots.sql"),
    ]

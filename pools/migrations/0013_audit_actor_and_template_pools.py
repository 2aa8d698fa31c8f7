"""The audit trail (PoolEvent.actor) and per-key pools (Pool.template)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("pools", "0012_idempotency"),
    ]

    operations = [
        migrations.AddField(
            model_name="pool",
            name="template",
            field=models.CharField(
                blank=True,
                db_default="",
                default="",
                editable=False,
                max_length=100,
                verbose_name="template",
            ),
        ),
        migrations.AddField(
            model_name="poolevent",
            name="actor",
            field=models.CharField(
                blank=True, db_default="", default="", max_length=150, verbose_name="actor"
            ),
        ),
        migrations.AlterField(
            model_name="poolevent",
            name="kind",
            field=models.CharField(
                choices=[
                    ("enqueued", "enqueued"),
                    ("admitted", "admitted"),
                    ("started", "started"),
                    ("settled", "settled"),
                    ("requeued", "requeued"),
                    ("expired", "expired"),
                    ("cancelled", "cancelled"),
                    ("rejected", "rejected"),
                    ("dropped", "dropped"),
                    ("superseded", "superseded"),
                    ("skipped", "skipped delivery"),
                    ("capacity", "capacity changed"),
                    ("pool_created", "pool created"),
                    ("pool_deleted", "pool deleted"),
                    ("terminate", "termination requested"),
                ],
                max_length=12,
                verbose_name="kind",
            ),
        ),
    ]

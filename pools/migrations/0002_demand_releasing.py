"""Demand rows may be ``releasing``: settled while another transaction held the pool's lock
(docs/concepts/contention.md). A choice only: no column, index or SQL changes."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("pools", "0001_release_0_1_0"),
    ]

    operations = [
        migrations.AlterField(
            model_name="demand",
            name="state",
            field=models.CharField(
                choices=[
                    ("waiting", "waiting"),
                    ("admitted", "admitted"),
                    ("running", "running"),
                    ("succeeded", "succeeded"),
                    ("failed", "failed"),
                    ("cancelled", "cancelled"),
                    ("expired", "expired"),
                    ("rejected", "rejected"),
                    ("superseded", "superseded"),
                    ("retried", "retried"),
                    ("delayed", "delayed (not yet due)"),
                    ("releasing", "settled, slots not yet released"),
                ],
                default="waiting",
                max_length=12,
            ),
        ),
    ]

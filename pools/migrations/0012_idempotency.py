"""Idempotency keys: a stored generated column that holds the key while the entry is
unfinished, and a unique constraint on it (one unfinished entry per key)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("pools", "0011_admission_policies"),
    ]

    operations = [
        migrations.AddField(
            model_name="queueentry",
            name="idempotency_active",
            field=models.GeneratedField(
                db_persist=True,
                expression=models.Case(
                    models.When(
                        state__in=("waiting", "admitted", "running"),
                        then=models.F("idempotency_key"),
                    ),
                    default=models.Value(None),
                    output_field=models.CharField(max_length=255, null=True),
                ),
                output_field=models.CharField(max_length=255, null=True),
                verbose_name="active idempotency key",
            ),
        ),
        migrations.AddConstraint(
            model_name="queueentry",
            constraint=models.UniqueConstraint(
                fields=("idempotency_active",), name="pools_entry_idempotency_active"
            ),
        ),
    ]

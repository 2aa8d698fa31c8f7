from django.db import migrations, models


class Migration(migrations.Migration):
    """Pool.starts: the counter of rated starts (each rate's ring of body starts)."""

    dependencies = [
        ("pools", "0005_backoff"),
    ]

    operations = [
        migrations.AddField(
            model_name="pool",
            name="starts",
            field=models.PositiveBigIntegerField(
                db_default=0, default=0, editable=False, verbose_name="rated starts"
            ),
        ),
    ]

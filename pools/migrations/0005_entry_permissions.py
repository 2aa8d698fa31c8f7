"""Permissions of their own to cancel queue entries and to start periodic tasks by hand."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("pools", "0004_delayed_entries_out_of_line"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="queueentry",
            options={
                "permissions": [
                    ("cancel_queueentry", "Can cancel queue entries"),
                    ("start_job", "Can start a periodic task now (manual start)"),
                ],
                "verbose_name": "queue entry",
                "verbose_name_plural": "queue entries",
            },
        ),
    ]

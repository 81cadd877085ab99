"""Elastic jobs: a job may run at fewer ranks than it asks for, and each attempt
records the size it runs at.

Every attempt before this ran at its job's size, so it gets the job's `ranks`.
"""

from typing import Any

from django.db import migrations, models
from django.db.models import OuterRef, Subquery


def backfill(apps: Any, schema_editor: Any) -> None:
    Attempt = apps.get_model("preemption", "Attempt")
    Job = apps.get_model("preemption", "Job")
    Attempt.objects.filter(ranks__isnull=True).update(
        ranks=Subquery(Job.objects.filter(pk=OuterRef("job_id")).values("ranks")[:1])
    )


class Migration(migrations.Migration):
    dependencies = [
        ("preemption", "0017_rank_end_reason_disk_limit"),
    ]

    operations = [
        migrations.AddField(
            model_name="attempt",
            name="ranks",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="rank_sizes",
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.AddField(
            model_name="job",
            name="ranks_min",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.AddConstraint(
            model_name="job",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("ranks_min__isnull", True),
                    models.Q(("ranks_min__gte", 1), ("ranks_min__lt", models.F("ranks"))),
                    _connector="OR",
                ),
                name="job_ranks_min_below_ranks",
            ),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]

"""Each preemption keeps the step its job was to resume from when it was requeued.

Preemptions requeued before this field existed get it from the checkpoints their
job had committed by the moment of the requeue, which is what the reconciler
would have stored then.
"""

from typing import Any

from django.db import migrations, models
from django.db.models import Max


def backfill(apps: Any, schema_editor: Any) -> None:
    PreemptionEvent = apps.get_model("preemption", "PreemptionEvent")
    Checkpoint = apps.get_model("preemption", "Checkpoint")
    requeued = PreemptionEvent.objects.filter(requeued_at__isnull=False, resume_step__isnull=True)
    for event in requeued.iterator():
        last = Checkpoint.objects.filter(
            job_id=event.job_id, committed_at__lte=event.requeued_at
        ).aggregate(step=Max("step"))["step"]
        if last is not None:
            PreemptionEvent.objects.filter(pk=event.pk).update(resume_step=last + 1)


class Migration(migrations.Migration):
    dependencies = [
        ("preemption", "0003_trap_tokens_per_attempt"),
    ]

    operations = [
        migrations.AddField(
            model_name="preemptionevent",
            name="resume_step",
            field=models.PositiveIntegerField(blank=True, null=True),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]

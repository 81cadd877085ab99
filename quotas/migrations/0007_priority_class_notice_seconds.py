from django.db import migrations, models
from django.db.models import F
from django.db.models.functions import Least


def fit_inside_grace(apps, schema_editor):
    # A class whose grace period is 60 s or less gets half of it, so that every
    # existing class keeps a notice window shorter than its grace period.
    PriorityClass = apps.get_model("quotas", "PriorityClass")
    PriorityClass.objects.update(notice_seconds=Least(30, F("grace_seconds") / 2))


class Migration(migrations.Migration):
    dependencies = [
        ("quotas", "0006_scheduling_policy"),
    ]

    operations = [
        migrations.AddField(
            model_name="priorityclass",
            name="notice_seconds",
            field=models.PositiveIntegerField(db_default=30, default=30),
        ),
        migrations.RunPython(fit_inside_grace, migrations.RunPython.noop),
    ]

"""Teams get the priority classes they may use and a default class.

Existing installations keep working: every top-level team is allowed every
class that exists at the time of the migration, and sub-teams inherit that
list. Admins narrow it afterwards; a class added later is allowed to nobody
until an admin says so (except the installation's default class, which a
top-level team without a list of its own may always use).
"""

import django.db.models.deletion
from django.db import migrations, models


def allow_existing_classes(apps, schema_editor):
    Team = apps.get_model("quotas", "Team")
    PriorityClass = apps.get_model("quotas", "PriorityClass")
    classes = list(PriorityClass.objects.all())
    for team in Team.objects.filter(parent__isnull=True):
        team.priority_classes.set(classes)


def forget_allowances(apps, schema_editor):
    Team = apps.get_model("quotas", "Team")
    for team in Team.objects.all():
        team.priority_classes.clear()


class Migration(migrations.Migration):
    dependencies = [
        ("quotas", "0002_seed_priority_classes"),
    ]

    operations = [
        migrations.AddField(
            model_name="team",
            name="default_priority_class",
            field=models.ForeignKey(
                blank=True,
                help_text="The class of a job submitted without one; empty: the parent team's.",
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="default_for_teams",
                to="quotas.priorityclass",
            ),
        ),
        migrations.AddField(
            model_name="team",
            name="priority_classes",
            field=models.ManyToManyField(
                blank=True,
                help_text="The classes this team's jobs may use; empty: the parent team's.",
                related_name="allowed_teams",
                to="quotas.priorityclass",
            ),
        ),
        migrations.RunPython(allow_existing_classes, forget_allowances),
    ]

"""The mission's two priority classes exist in every installation."""

from django.db import migrations


def seed(apps, schema_editor):
    PriorityClass = apps.get_model("quotas", "PriorityClass")
    PriorityClass.objects.get_or_create(
        name="ai-prod-critical",
        defaults={
            "value": 1_000_000,
            "preemption_policy": "PreemptLowerPriority",
            "preemptible": False,
            "grace_seconds": 90,
            "description": "Production-critical work: never preempted, preempts lower classes.",
            "is_default": False,
        },
    )
    PriorityClass.objects.get_or_create(
        name="ai-batch-preemptible",
        defaults={
            "value": 10_000,
            "preemption_policy": "Never",
            "preemptible": True,
            "grace_seconds": 60,
            "description": "Batch training: may borrow idle GPUs and is checkpointed and requeued when preempted.",
            "is_default": True,
        },
    )


def unseed(apps, schema_editor):
    apps.get_model("quotas", "PriorityClass").objects.filter(
        name__in=["ai-prod-critical", "ai-batch-preemptible"], jobs__isnull=True
    ).delete()


class Migration(migrations.Migration):
    dependencies = [("quotas", "0001_initial")]
    operations = [migrations.RunPython(seed, unseed)]

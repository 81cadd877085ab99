"""What Quartermaster measures: utilization samples, drill runs and simulation runs."""

from __future__ import annotations

from django.db import models

from quotas.models import ResourceFlavor, Team


class UtilizationSample(models.Model):
    """GPUs a team used, was guaranteed and borrowed of one flavor at one moment."""

    at = models.DateTimeField(db_index=True)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="utilization_samples")
    flavor = models.ForeignKey(ResourceFlavor, on_delete=models.CASCADE, related_name="+")
    used = models.PositiveIntegerField()
    guarantee = models.PositiveIntegerField()
    borrowed = models.PositiveIntegerField()
    lent = models.PositiveIntegerField(default=0)
    fair_share = models.FloatField(default=0.0)
    capacity = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["at", "team_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["at", "team", "flavor"], name="one_sample_per_team_flavor_moment"
            )
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M} team {self.team_id}: {self.used}/{self.guarantee}"


class DrillRun(models.Model):
    """One run of `manage.py drill`: its settings and every figure it measured."""

    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    runtime = models.CharField(max_length=16)
    ranks = models.PositiveIntegerField()
    grace_seconds = models.FloatField()
    chaos_rounds = models.PositiveIntegerField(default=0)
    passed = models.BooleanField(default=False)
    result = models.JSONField(default=dict)

    class Meta:
        ordering = ["-started_at", "-id"]

    def __str__(self) -> str:
        return f"drill {self.started_at:%Y-%m-%d %H:%M} {self.runtime} {self.ranks} ranks"


class SimulationRun(models.Model):
    """One trace replay (`manage.py simulate`): its options and its JSON report,
    charted on the telemetry pages."""

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    policy = models.CharField(max_length=16)
    trace = models.CharField(max_length=300)
    options = models.JSONField(default=dict)
    report = models.JSONField(default=dict)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"simulation {self.created_at:%Y-%m-%d %H:%M} {self.policy} {self.trace}"

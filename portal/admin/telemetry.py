"""Django admin for what Quartermaster measured; all of it is read-only."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from telemetry.models import DrillRun, SimulationRun, UtilizationSample


class MeasuredAdmin(admin.ModelAdmin):
    """Measurements are facts: they are looked at, never edited."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(UtilizationSample)
class UtilizationSampleAdmin(MeasuredAdmin):
    list_display = ["at", "team", "flavor", "used", "guarantee", "borrowed", "lent", "capacity"]
    list_filter = ["flavor", "team"]
    date_hierarchy = "at"


@admin.register(DrillRun)
class DrillRunAdmin(MeasuredAdmin):
    list_display = ["started_at", "runtime", "ranks", "grace_seconds", "chaos_rounds", "passed"]
    list_filter = ["runtime", "passed"]


@admin.register(SimulationRun)
class SimulationRunAdmin(MeasuredAdmin):
    list_display = ["created_at", "policy", "trace"]
    list_filter = ["policy"]

"""The REST API's routes under /api/v1/."""

from django.http import HttpRequest, JsonResponse
from django.urls import path, re_path
from django.views.decorators.csrf import csrf_exempt
from rest_framework.routers import DefaultRouter

from portal.rest.preemption import (
    AttemptViewSet,
    CheckpointViewSet,
    JobViewSet,
    PreemptionEventViewSet,
    RankViewSet,
    WebhookViewSet,
)
from portal.rest.quotas import (
    AuditEntryViewSet,
    FlavorViewSet,
    NodeViewSet,
    PriorityClassViewSet,
    QuotaViewSet,
    SchedulingPolicyView,
    TeamViewSet,
)
from portal.rest.tokens import ApiTokenViewSet
from portal.rest.usage import FragmentationView, UsageView

router = DefaultRouter()
router.register("flavors", FlavorViewSet, basename="flavor")
router.register("nodes", NodeViewSet, basename="node")
router.register("teams", TeamViewSet, basename="team")
router.register("quotas", QuotaViewSet, basename="quota")
router.register("priority-classes", PriorityClassViewSet, basename="priority-class")
router.register("jobs", JobViewSet, basename="job")
router.register("attempts", AttemptViewSet, basename="attempt")
router.register("ranks", RankViewSet, basename="rank")
router.register("preemption-events", PreemptionEventViewSet, basename="preemption-event")
router.register("checkpoints", CheckpointViewSet, basename="checkpoint")
router.register("audit-log", AuditEntryViewSet, basename="audit-entry")
router.register("tokens", ApiTokenViewSet, basename="api-token")
router.register("webhooks", WebhookViewSet, basename="webhook")


@csrf_exempt
def api_not_found(request: HttpRequest, unmatched: str) -> JsonResponse:
    """Any other address under /api/v1/ answers a JSON 404, like the API's own."""
    return JsonResponse(
        {"detail": f"/api/v1/{unmatched} is not an address of this API (ids are whole numbers)."},
        status=404,
    )


urlpatterns = [
    *router.urls,
    path("usage/", UsageView.as_view(), name="usage"),
    path("fragmentation/", FragmentationView.as_view(), name="fragmentation"),
    path("scheduling-policy/", SchedulingPolicyView.as_view(), name="scheduling-policy"),
    re_path(r"^(?P<unmatched>[\s\S]*)$", api_not_found),
]

"""REST API of what the cluster uses now: GPUs used, guaranteed and borrowed per
flavor and per readable team, from the same selector as the dashboard, the team
pages and /metrics, so every surface shows the same figures."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import responses
from portal.rest.access import access_of
from telemetry.selectors import UsageNow, flavors_now, free_blocks, team_rows


class FlavorUsageSerializer(serializers.Serializer[object]):
    flavor = serializers.CharField(source="name")
    capacity = serializers.IntegerField()
    guaranteed = serializers.IntegerField(help_text="Guarantees of the top-level teams.")
    used = serializers.IntegerField()
    borrowed = serializers.IntegerField(
        help_text="GPUs top-level teams use beyond their guarantees, summed."
    )
    idle = serializers.IntegerField()


class TeamUsageSerializer(serializers.Serializer[object]):
    team = serializers.CharField()
    parent = serializers.CharField(allow_null=True)
    flavor = serializers.CharField()
    guarantee = serializers.IntegerField()
    used = serializers.IntegerField(help_text="GPUs the team's subtree holds now.")
    borrowed = serializers.IntegerField(help_text="max(0, used - guarantee), now.")


class UsageSerializer(serializers.Serializer[object]):
    flavors = FlavorUsageSerializer(many=True)
    teams = TeamUsageSerializer(many=True)


class UsageView(APIView):
    """GPUs used and borrowed now: cluster totals per flavor (no team names),
    and one row per readable team and flavor with a quota or usage."""

    @extend_schema(summary="GPUs used and borrowed now", responses=responses(UsageSerializer, 401))
    def get(self, request: Request) -> Response:
        access = access_of(request)
        usage = UsageNow.load(access.tree)
        teams = [
            {
                "team": row.slug,
                "parent": row.parent_slug,
                "flavor": flavor,
                "guarantee": figures.guarantee,
                "used": figures.used,
                "borrowed": figures.borrowed,
            }
            for row in team_rows(access=access, usage=usage)
            for flavor, figures in row.flavors.items()
            if figures.has_quota or figures.used
        ]
        body = {"flavors": flavors_now(usage), "teams": teams}
        return Response(UsageSerializer(body).data)


class FreeBlockSerializer(serializers.Serializer[object]):
    flavor = serializers.CharField()
    level = serializers.CharField(help_text="`node`, or a topology level such as rack.")
    largest = serializers.IntegerField(help_text="The most free GPUs inside one domain.")
    domain = serializers.CharField(help_text="The domain that has them; empty: none free.")
    domains = serializers.IntegerField(help_text="The flavor's domains at this level.")
    free = serializers.IntegerField(help_text="The flavor's free GPUs in all.")


class FragmentationView(APIView):
    """The largest block of free GPUs per flavor and level (each node, each rack,
    each block...): cluster-wide figures without team names, as the dashboard shows."""

    @extend_schema(
        summary="Largest free block per flavor and topology level",
        responses=responses(FreeBlockSerializer(many=True), 401),
    )
    def get(self, request: Request) -> Response:
        return Response(FreeBlockSerializer(free_blocks(), many=True).data)

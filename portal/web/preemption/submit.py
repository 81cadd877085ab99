"""The job submission page: one job queued from the browser as POST /api/v1/jobs/
queues it, and "Submit again", the same page filled in from a job the user can see.

The form only turns what a person typed into the API's request: the environment's
NAME=VALUE lines into a mapping, "required" or "preferred" into the topology's
boolean, and empty fields left out so the API's defaults apply. Every rule is the
API's: the request is checked by `checked_submission` (types, names, whether the
user may submit to the team), the serializer POST /jobs/ uses, and then by the
`job_submit` service (sizes, capacity, classes, formats). So the page refuses
exactly what the API refuses, in the same words, and a refusal queues nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from rest_framework import exceptions as api_exceptions

from core.access import Access
from core.forms import add_service_errors
from portal.rest.preemption_serializers import MAX_ID, JobSubmitSerializer, checked_submission
from preemption.models import Job
from preemption.selectors import job_list as job_selector
from preemption.services import MAX_RETRIES, job_submit
from quotas.models import PriorityClass, ResourceFlavor, Team
from quotas.selectors import PriorityAllowance, access_for, priority_allowances, topology_levels

# The topology's boolean as the form offers it: a word a person reads, not true/false.
TOPOLOGY_REQUIRED = {"required": True, "preferred": False}

# What the form sends to the API as typed (text), when it is not empty.
TYPED_FIELDS = (
    "team",
    "name",
    "flavor",
    "ranks",
    "gpus_per_rank",
    "priority_class",
    "image",
    "command",
    "retries",
    "topology_level",
)


def _api_help(field: str) -> str:
    """The API's own description of a field, so the page and the API docs say the same."""
    return str(JobSubmitSerializer().fields[field].help_text or "")


def _text(**kwargs: Any) -> forms.CharField:
    # Nothing is stripped or required here: the API decides what is missing or
    # wrong, with its messages (the command keeps its spaces, as the API keeps them).
    return forms.CharField(required=False, strip=False, **kwargs)


class JobSubmitForm(forms.Form):
    """One job as a person types it. The choices are the user's: the teams they may
    submit to, every flavor, and the priority classes of the chosen team."""

    team = _text(widget=forms.Select)
    name = _text(widget=forms.TextInput(attrs={"placeholder": "e.g. resnet-sweep-3"}))
    flavor = _text(widget=forms.Select)
    ranks = _text(
        widget=forms.TextInput(attrs={"inputmode": "numeric", "placeholder": "8 or 2:8"}),
        label="Ranks",
        help_text=(
            "A number, or an elastic job's range: 2:8 runs at any size from 2 to 8 ranks, "
            "2,4,8 only at those; it starts at the largest that fits."
        ),
    )
    gpus_per_rank = _text(widget=forms.NumberInput(attrs={"min": 1}), label="GPUs per rank")
    priority_class = _text(
        widget=forms.Select,
        label="Priority class",
        help_text="The classes this team may use; its default is chosen until you pick another.",
    )
    image = _text(
        widget=forms.TextInput(attrs={"placeholder": "registry.example.org/team/trainer:1.4"})
    )
    command = _text(widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false"}))
    env = _text(
        widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false"}),
        label="Environment",
    )
    retries = _text(
        widget=forms.NumberInput(attrs={"min": 0, "max": MAX_RETRIES}), label="Retries on failure"
    )
    topology_level = _text(widget=forms.Select, label="Topology level")
    topology_required = _text(
        widget=forms.RadioSelect(
            choices=[
                ("required", "required: wait until one domain has room"),
                ("preferred", "preferred: one domain if one has room, else anywhere"),
            ]
        ),
        label="Keep the ranks together",
    )

    def __init__(
        self,
        *args: Any,
        teams: list[str],
        flavors: list[str],
        allowances: Mapping[str, PriorityAllowance],
        levels: list[str],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.allowances = allowances
        self.fields["team"].widget.choices = [(slug, slug) for slug in teams]
        self.fields["flavor"].widget.choices = [(name, name) for name in flavors]
        self.fields["topology_level"].widget.choices = [("", "anywhere")] + [
            (level, level) for level in levels
        ]
        self.fields["priority_class"].widget.choices = [
            (pc.name, class_label(pc)) for pc in self.allowance.allowed
        ]
        self.fields["command"].help_text = _api_help("command")
        self.fields["image"].help_text = f"{_api_help('image')} Empty: the runtime's default image."
        self.fields["env"].help_text = f"One NAME=VALUE a line. {_api_help('env')}"
        self.fields["retries"].help_text = _api_help("retries")
        self.fields["topology_level"].help_text = _api_help("topology_level")
        # A new form chooses the team's default class, unless it was filled in from a
        # job whose class the team may still use.
        allowance = self.allowance
        kept = any(pc.name == self.initial.get("priority_class") for pc in allowance.allowed)
        if not self.is_bound and not kept and allowance.default is not None:
            self.initial["priority_class"] = allowance.default.name

    @property
    def allowance(self) -> PriorityAllowance:
        """The priority classes of the team the form shows (the first team's by default)."""
        chosen = self["team"].value()
        if chosen not in self.allowances:
            chosen = next(iter(self.allowances), None)
        if chosen is None:
            return PriorityAllowance(team="", allowed=(), default=None, source=None)
        return self.allowances[chosen]

    def class_choices(self) -> dict[str, dict[str, Any]]:
        """Every offered team's classes and default, for the page's script to offer
        when the team changes (what GET /api/v1/teams/<id>/priority-classes/ answers)."""
        return {
            slug: {
                "allowed": [[pc.name, class_label(pc)] for pc in allowance.allowed],
                "default": allowance.default.name if allowance.default else None,
            }
            for slug, allowance in self.allowances.items()
        }

    def clean_env(self) -> dict[str, str]:
        """The NAME=VALUE lines as the API's mapping; blank lines are skipped. The
        names and values themselves are the API's to judge."""
        env: dict[str, str] = {}
        first_line: dict[str, int] = {}
        for number, line in enumerate(self.cleaned_data["env"].splitlines(), start=1):
            if not line.strip():
                continue
            name, sep, value = line.partition("=")
            if not sep or not name:
                raise forms.ValidationError(f"Line {number} is not NAME=VALUE (got {line[:80]!r}).")
            if name in env:
                raise forms.ValidationError(
                    f"{name[:80]} is set twice (lines {first_line[name]} and {number})."
                )
            env[name] = value
            first_line[name] = number
        return env

    def api_request(self) -> dict[str, Any]:
        """What POST /api/v1/jobs/ would be sent for this form."""
        data = self.cleaned_data
        request: dict[str, Any] = {field: data[field] for field in TYPED_FIELDS if data[field]}
        if "ranks" in request:
            request["ranks"] = ranks_request(request["ranks"])
        request["env"] = data["env"]
        required = data["topology_required"]
        if required:
            # Anything but the two words goes on as typed, for the API to refuse.
            request["topology_required"] = TOPOLOGY_REQUIRED.get(required, required)
        return request

    def add_api_errors(self, detail: Any) -> None:
        """Show the API's 400 answer (`{field: [reasons]}`) on the fields it names."""
        if not isinstance(detail, dict):
            detail = {None: detail}
        for field, reasons in detail.items():
            target = field if field in self.fields else None
            for reason in _reasons(reasons):
                self.add_error(target, reason)


def ranks_request(typed: str) -> Any:
    """The API's `ranks` for what a person typed: "8" as typed, "2:8" as
    {"min": 2, "max": 8}, "2,4,8" as {"sizes": [2, 4, 8]}. A part that is not a
    number goes on as typed, for the API to refuse in its words."""

    def part(text: str) -> Any:
        text = text.strip()
        return int(text) if text.isdigit() else text

    if ":" in typed:
        low, _, high = typed.partition(":")
        return {"min": part(low), "max": part(high)}
    if "," in typed:
        return {"sizes": [part(size) for size in typed.split(",")]}
    return typed


def ranks_typed(job: Job) -> str:
    """A job's sizes as the form takes them: "8", "2:8" or "2,4,8"."""
    if job.ranks_min is None:
        return str(job.ranks)
    if job.rank_sizes:
        return ",".join(map(str, job.rank_sizes))
    return f"{job.ranks_min}:{job.ranks}"


def _reasons(reasons: Any) -> list[str]:
    """The reasons of one field, flat: the environment's are by variable name."""
    if isinstance(reasons, dict):
        return [f"{key}: {reason}" for key, inner in reasons.items() for reason in _reasons(inner)]
    if isinstance(reasons, list):
        return [reason for inner in reasons for reason in _reasons(inner)]
    return [str(reasons)]


def class_label(priority_class: PriorityClass) -> str:
    """A class as the form offers it: its name and what it means for a job."""
    if priority_class.preemptible:
        return f"{priority_class.name} (preemptible, {priority_class.grace_seconds} s grace)"
    return f"{priority_class.name} (not preemptible)"


def submittable_teams(access: Access) -> list[Team]:
    """The leaf teams the user may submit to: jobs go to leaf teams only, so an
    inner team, whose every job the API refuses, is not offered."""
    tree = access.tree
    ids = [team_id for team_id in tree.parent if tree.is_leaf(team_id)]
    return list(
        Team.objects.filter(id__in=[i for i in ids if access.can_submit_to(i)]).order_by("slug")
    )


def _initial_from(job: Job) -> dict[str, Any]:
    """The form filled in from an earlier job, to submit it again."""
    return {
        "team": job.team.slug,
        "name": job.name,
        "flavor": job.flavor.name,
        "ranks": ranks_typed(job),
        "gpus_per_rank": job.gpus_per_rank,
        "priority_class": job.priority_class.name,
        "image": job.image,
        "command": job.command,
        # By name: PostgreSQL's jsonb keeps keys in its own order, SQLite as written.
        "env": "\n".join(f"{name}={value}" for name, value in sorted((job.env or {}).items())),
        "retries": job.retries,
        "topology_level": job.topology_level,
        "topology_required": "required" if job.topology_required else "preferred",
    }


def _job_to_repeat(request: HttpRequest, value: str) -> Job:
    """The job named by `?from=`, if the user may see it; 404 as its page answers."""
    if not value.isdigit() or int(value) > MAX_ID:
        raise Http404(f"There is no job {value[:40]!r} to submit again.")
    return get_object_or_404(
        job_selector(user=request.user).select_related("team", "flavor", "priority_class"),
        pk=int(value),
    )


@login_required
def job_submit_page(request: HttpRequest) -> HttpResponse:
    """Submit a job to a team the user may submit to; on success, the new job's page.
    `?from=<id>` fills the form in from that job ("Submit again")."""
    access = access_for(request.user)
    teams = submittable_teams(access)
    allowances = priority_allowances(team_ids=[team.pk for team in teams], tree=access.tree)
    choices: dict[str, Any] = {
        "teams": [team.slug for team in teams],
        "flavors": list(ResourceFlavor.objects.order_by("name").values_list("name", flat=True)),
        "allowances": {team.slug: allowances[team.pk] for team in teams},
        "levels": list(topology_levels()),
    }
    status = 200
    repeated: Job | None = None
    if request.method == "POST":
        form = JobSubmitForm(request.POST, **choices)
        status = 400
        if form.is_valid():
            try:
                values = checked_submission(form.api_request(), access=access)
                job = job_submit(submitter=request.user, tree=access.tree, **values)
            except api_exceptions.PermissionDenied as refusal:
                form.add_error("team", str(refusal.detail))
                status = 403
            except api_exceptions.ValidationError as error:
                form.add_api_errors(error.detail)
            except ValidationError as error:
                add_service_errors(form, error)
            else:
                messages.success(request, f"Queued job #{job.pk}.")
                return redirect("job-detail", pk=job.pk)
    else:
        initial: dict[str, Any] = {"retries": 0, "topology_required": "required"}
        if "from" in request.GET:
            repeated = _job_to_repeat(request, request.GET["from"])
            initial = _initial_from(repeated)
        form = JobSubmitForm(initial=initial, **choices)
    return render(
        request,
        "preemption/job_submit.html",
        {
            "form": form,
            "repeated": repeated,
            "class_choices": form.class_choices(),
            "nav": "job-submit",
        },
        status=status,
    )

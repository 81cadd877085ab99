"""What each page shows: the dashboard's figures, the quota editor's preview
and messages, a preemption's timeline in words, telemetry figures and CSV,
tokens, health, metrics and the assets served from packages."""

from __future__ import annotations

import gzip
import json
import re
from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from portal.models import ApiToken
from preemption.models import Attempt, Job, JobState
from quotas.models import AuditEntry, Quota
from quotas.services import team_priority_classes_set
from telemetry.models import UtilizationSample
from telemetry.services import utilization_sample
from tests import builders
from tests.portal.pages.conftest import page_client, seed_drill, seed_jobs

pytestmark = pytest.mark.django_db


def _running(world: Any, team: Any, gpus: int, borrowed: int = 0, node: str = "h100-node-0") -> Job:
    return builders.running_job(
        world,
        team,
        name=f"{team.slug}-run",
        submitter=world.users["admin"],
        gpus_per_rank=gpus,
        command="python train.py",
        node=node,
        borrowed=borrowed,
        # Running for an hour: past the minute in which fair-share moves spare a job.
        admitted_at=timezone.now() - timedelta(hours=1),
    )


def test_dashboard_shows_flavor_figures_team_bars_queue_and_preemptions(
    world: Any, history: Any
) -> None:
    Job.objects.filter(state=JobState.RUNNING).exclude(pk=history.victim.pk).update(
        state=JobState.SUCCEEDED
    )
    history.preemptor.state = JobState.SUCCEEDED
    history.preemptor.save(update_fields=["state"])
    _running(world, world.nlp, 8)
    _running(world, world.ops, 4, borrowed=0)
    # The victim (ops, 2 x 4 GPUs, attempt 2 open) is running again.
    body = page_client(world, "admin").get(reverse("dashboard")).content.decode()
    card = body[body.index('data-flavor="h100-80gb"') :]
    card = card[: card.index("</article>")]
    figures = dict(re.findall(r'data-figure="(\w+)">(\d+)<', card))
    # ops holds 12 of its top-level team's 8: 4 borrowed, whatever its attempts
    # recorded when they were admitted.
    assert figures == {"used": "20", "guaranteed": "24", "borrowed": "4", "idle": "4"}
    assert 'data-team="nlp" data-flavor="h100-80gb"' in body
    assert "waiting for 2 GPUs of h100-80gb; borrowing is full" in body
    assert "reclaimed by vision, 8 GPUs under its guarantee" in body


def test_team_detail_shows_quotas_children_and_audit_to_its_manager(world: Any) -> None:
    client = page_client(world, "manager")
    quota = world.quota(world.vision)
    client.post(
        reverse("quota-edit", args=[quota.pk]),
        {"guarantee": 6, "borrow_limit": "", "lend_limit": 2, "action": "save"},
    )
    body = client.get(reverse("team-detail", args=["ml"])).content.decode()
    assert 'data-team="vision"' in body and 'data-team="nlp"' in body
    assert "quota.set" in body
    assert "<del>8</del> → <strong>6</strong>" in body
    researcher = page_client(world, "researcher").get(reverse("team-detail", args=["vision"]))
    assert "quota.set" not in researcher.content.decode()


def test_quota_preview_shows_consequences_and_saves_nothing(world: Any) -> None:
    client = page_client(world, "manager")
    quota = world.quota(world.vision)
    before = AuditEntry.objects.count()
    response = client.post(reverse("quota-preview", args=[quota.pk]), {"guarantee": 4})
    assert response.status_code == 200
    body = response.content.decode()
    assert 'id="preview-result"' in body
    assert "guarantee <strong>8 → 4</strong>" in body
    quota.refresh_from_db()
    assert quota.guarantee == 8
    assert AuditEntry.objects.count() == before


def test_team_page_names_the_priority_classes_its_jobs_may_use(world: Any) -> None:
    team_priority_classes_set(
        actor=world.users["admin"], team=world.ml, priority_classes=[world.batch], may_widen=True
    )
    body = page_client(world, "researcher").get(reverse("team-detail", args=["vision"]))
    text = body.content.decode()
    assert "Jobs may use <strong>ai-batch-preemptible</strong> (default) · as ml allows." in text
    assert "ai-prod-critical</strong>" not in text
    # The manager of ml reads the change in the audit history of the team's page.
    managed = page_client(world, "manager").get(reverse("team-detail", args=["ml"]))
    assert managed.status_code == 200 and "team.priority_classes" in managed.content.decode()


def test_quota_preview_says_what_never_preempted_work_needs(world: Any) -> None:
    now = timezone.now()
    serve = Job.objects.create(
        name="serve",
        team=world.vision,
        submitter=world.users["researcher"],
        priority_class=world.critical,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=2,
        command="sleep 60",
        state=JobState.RUNNING,
        admitted_at=now,
        running_at=now,
    )
    Attempt.objects.create(
        job=serve, number=1, placement=[{"node": "h100-node-0", "ranks": 1}], admitted_at=now
    )
    Job.objects.create(
        name="big-serve",
        team=world.vision,
        submitter=world.users["researcher"],
        priority_class=world.critical,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=6,
        command="sleep 60",
    )
    client = page_client(world, "manager")
    quota = world.quota(world.vision)
    body = client.post(reverse("quota-preview", args=[quota.pk]), {"guarantee": 4}).content.decode()
    assert "Never-preempted jobs hold 2 GPUs here" in body
    assert "the guarantee cannot go below 2." in body
    assert "1 waiting never-preempted job could never start" in body
    assert "it needs 6 GPUs of h100-80gb, the guarantee would be 4." in body
    blocked = client.post(reverse("quota-preview", args=[quota.pk]), {"guarantee": 1})
    assert (
        "Must be a whole number from 2 to 8: vision runs 2 GPUs of h100-80gb in non-preemptible "
        f"jobs (job {serve.pk} (serve))"
    ) in blocked.content.decode()


def test_quota_preview_names_running_jobs_that_would_be_reclaimed(world: Any) -> None:
    # 8 of the 24 GPUs are nobody's guarantee; ops borrows them while vision,
    # guaranteed nothing, waits. Raising org's guarantee to 16 flows down to
    # vision through ml, so vision reclaims what ops borrowed.
    for team, guarantee in ((world.org, 8), (world.ml, 8), (world.vision, 0)):
        Quota.objects.filter(team=team, flavor=world.h100).update(guarantee=guarantee)
    _running(world, world.nlp, 8, node="h100-node-0")
    _running(world, world.ops, 8, node="h100-node-1")
    borrower = _running(world, world.ops, 8, borrowed=8, node="h100-node-2")
    Job.objects.create(
        name="wants-guarantee",
        team=world.vision,
        submitter=world.users["researcher"],
        priority_class=world.batch,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=8,
        command="python train.py",
    )
    quota = world.quota(world.org)
    response = page_client(world, "admin").post(
        reverse("quota-preview", args=[quota.pk]), {"guarantee": 16}
    )
    body = response.content.decode()
    assert response.status_code == 200
    assert "1 running job would be preempted" in body, body
    assert f'href="/jobs/{borrower.pk}/"' in body


def test_invalid_quota_edit_shows_the_service_message_and_changes_nothing(world: Any) -> None:
    client = page_client(world, "manager")
    quota = world.quota(world.vision)
    before = AuditEntry.objects.count()
    response = client.post(
        reverse("quota-edit", args=[quota.pk]), {"guarantee": 12, "action": "save"}
    )
    assert response.status_code == 400
    assert (
        "Must be a whole number from 0 to 8: ml has 16 GPUs of h100-80gb and its other sub-teams hold 8 (got 12)."
        in response.content.decode()
    )
    negative = client.post(reverse("quota-preview", args=[quota.pk]), {"guarantee": -3})
    assert negative.status_code == 400
    assert "Must be a whole number from 0 to 8: ml has 16 GPUs" in negative.content.decode()
    assert "(got -3)." in negative.content.decode()
    not_a_number = client.post(
        reverse("quota-edit", args=[quota.pk]), {"guarantee": "eight", "action": "save"}
    )
    assert not_a_number.status_code == 400
    assert "Must be a whole number from 0 to 8: ml has 16 GPUs" in not_a_number.content.decode()
    assert "(got eight)." in not_a_number.content.decode()
    quota.refresh_from_db()
    assert quota.guarantee == 8
    assert AuditEntry.objects.count() == before


def test_job_page_tells_the_preemption_from_decision_to_resume(world: Any, history: Any) -> None:
    victim = history.victim
    body = (
        page_client(world, "other_researcher")
        .get(reverse("job-detail", args=[victim.pk]))
        .content.decode()
    )
    assert "Reclaimed by vision, 8 GPUs under its guarantee." in body
    titles = re.findall(r"<strong>([^<]+)</strong>", body[body.index('class="timeline"') :])
    steps = [
        t
        for t in titles
        if t
        in {
            "Preemption decided",
            "Signal sent to all 2 ranks",
            "Every rank received the signal (2 of 2)",
            "Checkpoint started",
            "Checkpoint committed",
            "Every rank exited",
            "Requeued",
            "Resumed",
        }
    ]
    assert steps == [
        "Preemption decided",
        "Signal sent to all 2 ranks",
        "Every rank received the signal (2 of 2)",
        "Checkpoint started",
        "Checkpoint committed",
        "Every rank exited",
        "Requeued",
        "Resumed",
    ]
    assert "+0.40 s" in body  # the last rank heard the signal 0.4 s after the decision
    assert "step 120, 50.0 MB in 4.50 s" in body
    assert "attempt 2, from step 121" in body
    assert "/ckpt/step_120" in body
    assert reverse("rank-log", args=[victim.pk, 2, 1]) in body


def test_job_list_filters_by_team_user_state_and_time(world: Any) -> None:
    jobs = seed_jobs(world, 30)
    client = page_client(world, "admin")

    def listed(**query: str) -> set[int]:
        body = client.get(reverse("job-list"), query).content.decode()
        return {int(pk) for pk in re.findall(r'data-job="(\d+)"', body)}

    assert listed(team="ops") == {j.pk for j in jobs if j.team_id == world.ops.pk}
    assert listed(user="researcher") == {j.pk for j in jobs if j.team_id == world.vision.pk}
    assert listed(state="requeued") == {j.pk for j in jobs if j.state == "requeued"}
    tomorrow = (timezone.now() + timedelta(days=1)).date().isoformat()
    assert listed(since=tomorrow) == set()
    assert len(listed()) == 30
    # A researcher cannot widen the list by naming another team.
    body = page_client(world, "researcher").get(reverse("job-list"), {"team": "ops"})
    shown = {int(pk) for pk in re.findall(r'data-job="(\d+)"', body.content.decode())}
    assert shown == {j.pk for j in jobs if j.team_id == world.vision.pk}


def test_telemetry_embeds_figures_with_the_seeded_values(world: Any, history: Any) -> None:
    body = page_client(world, "manager").get(reverse("telemetry")).content.decode()
    figures = {
        name: json.loads(payload)
        for name, payload in re.findall(
            r'<script type="application/json" id="figure-([\w-]+)">(.*?)</script>', body, re.S
        )
    }
    assert set(figures) == {
        "utilization",
        "borrowed",
        "latency",
        "checkpoint",
        "exit-codes",
        "recovery",
        "stops",
        "resize-lost-work",
        "resize-free-time",
    }
    traces = {trace["name"]: trace for trace in figures["utilization"]["data"]}
    # The manager of ml sees ml's children stacked: vision and nlp.
    assert traces["vision used"]["y"] == [4, 5, 6, 7, 8, 9]
    assert traces["nlp used"]["y"] == [2, 3, 4, 5, 6, 7]
    assert traces["vision guarantee"]["y"] == [8] * 6
    assert "ops used" not in traces
    # The reclaimed job belongs to ops: the manager of ml sees none of its figures.
    assert figures["latency"]["data"] == []
    admin = page_client(world, "admin").get(reverse("telemetry")).content.decode()
    latency = json.loads(re.search(r'id="figure-latency">(.*?)</script>', admin, re.S)[1])
    assert sorted(latency["data"][0]["x"]) == pytest.approx([0.3, 0.4])
    checkpoint = json.loads(re.search(r'id="figure-checkpoint">(.*?)</script>', admin, re.S)[1])
    # 4.5 s of a 60 s grace window: 4.5 / 60 = 7.5 % of the window.
    assert checkpoint["data"][0]["y"] == [0.075]
    assert checkpoint["data"][0]["customdata"][0][:2] == [4.5, 60.0]
    assert checkpoint["data"][1]["y"] == [1.0]
    assert "Signal reaches every rank" in admin and "0.42 s" in admin
    assert "41.50 s" in admin and "93 %" in admin


def test_gpu_hours_csv_counts_attempts_inside_the_period(world: Any) -> None:
    now = timezone.now()
    job = _running(world, world.vision, 4)
    Attempt.objects.filter(job=job).update(admitted_at=now - timedelta(hours=2))
    old = _running(world, world.nlp, 2)
    Attempt.objects.filter(job=old).update(
        admitted_at=now - timedelta(days=3), ended_at=now - timedelta(days=2, hours=23)
    )
    response = page_client(world, "admin").get(reverse("gpu-hours-csv"), {"period": "24h"})
    assert response["Content-Type"].startswith("text/csv")
    rows = [line.split(",") for line in response.content.decode().strip().splitlines()]
    assert rows[0][:4] == ["team", "flavor", "gpu_hours", "borrowed_gpu_hours"]
    assert [row[:2] for row in rows[1:]] == [["vision", "h100-80gb"]]
    assert float(rows[1][2]) == pytest.approx(8.0, abs=0.01)
    week = page_client(world, "admin").get(reverse("gpu-hours-csv"), {"period": "7d"})
    assert "nlp,h100-80gb,2.000" in week.content.decode()
    hidden = page_client(world, "other_researcher").get(reverse("gpu-hours-csv"))
    assert "vision" not in hidden.content.decode()


def test_utilization_sample_records_every_team_with_quota_or_usage(world: Any) -> None:
    _running(world, world.vision, 8)
    _running(world, world.nlp, 4, borrowed=0)
    _running(world, world.ops, 8, borrowed=2)
    moment = timezone.now()
    assert utilization_sample(moment) == 6
    assert utilization_sample(moment) == 0
    assert UtilizationSample.objects.count() == 6
    rows = {
        row.team.slug: (row.used, row.guarantee, row.borrowed, row.capacity)
        for row in UtilizationSample.objects.select_related("team")
    }
    assert rows["vision"] == (8, 8, 0, 24)
    assert rows["ml"] == (12, 16, 0, 24)
    assert rows["org"] == (12, 16, 0, 24)
    # Admitted with 2 borrowed, but ops holds only its own 8 now.
    assert rows["ops"] == (8, 8, 0, 24)


def test_metrics_exposes_usage_pending_preemptions_and_histograms(world: Any, history: Any) -> None:
    from portal.services import api_token_create

    _, value = api_token_create(user=world.users["admin"], name="prometheus")
    response = page_client(world, "anonymous").get(
        reverse("metrics"), HTTP_AUTHORIZATION=f"Bearer {value}"
    )
    assert response.status_code == 200
    text = response.content.decode()
    assert 'qm_gpu_guarantee{team="vision",flavor="h100-80gb"} 8' in text
    assert 'qm_gpus_used{team="ops",flavor="h100-80gb"} 8' in text
    assert re.search(r'qm_jobs_pending\{team="\w+",flavor="h100-80gb"\} \d+', text)
    assert 'qm_preemptions_total{reason="reclaim",outcome="graceful"} 1' in text
    assert 'qm_signal_latency_seconds_bucket{le="0.25"} 0' in text
    assert 'qm_signal_latency_seconds_bucket{le="0.5"} 2' in text
    assert "qm_signal_latency_seconds_count 2" in text
    assert "qm_signal_latency_seconds_sum 0.7" in text
    assert 'qm_checkpoint_duration_seconds_bucket{le="5"} 1' in text
    assert "# TYPE qm_checkpoint_duration_seconds histogram" in text
    assert page_client(world, "anonymous").get(reverse("metrics")).status_code == 401
    scoped = page_client(world, "researcher").get(reverse("metrics")).content.decode()
    assert 'team="vision"' in scoped and 'team="ops"' not in scoped


def test_tokens_are_created_shown_once_and_revoked(world: Any) -> None:
    client = page_client(world, "researcher")
    response = client.post(reverse("tokens"), {"name": "laptop"})
    body = response.content.decode()
    value = re.search(r'id="token-value">(qm_[^<]+)<', body)[1]
    token = ApiToken.objects.get(user=world.users["researcher"], name="laptop")
    assert value not in client.get(reverse("tokens")).content.decode()
    api = page_client(world, "anonymous").get("/api/v1/jobs/", HTTP_AUTHORIZATION=f"Bearer {value}")
    assert api.status_code == 200
    other = page_client(world, "other_researcher").post(reverse("token-revoke", args=[token.pk]))
    assert other.status_code == 404
    client.post(reverse("token-revoke", args=[token.pk]))
    token.refresh_from_db()
    assert token.revoked_at is not None
    api = page_client(world, "anonymous").get("/api/v1/jobs/", HTTP_AUTHORIZATION=f"Bearer {value}")
    assert api.status_code == 401
    empty = client.post(reverse("tokens"), {"name": "   "})
    assert empty.status_code == 400


def test_priority_classes_page_explains_the_seeded_classes(world: Any) -> None:
    seed_jobs(world, 8)
    body = page_client(world, "researcher").get(reverse("priority-classes")).content.decode()
    row = body[body.index('data-class="ai-batch-preemptible"') :]
    row = row[: row.index("</tr>")]
    assert "default" in row and "60 s" in row and "preemptible" in row
    assert 'data-class="ai-prod-critical"' in body and "90 s" in body


def test_healthz_and_plotly_from_the_package(world: Any) -> None:
    client = page_client(world, "anonymous")
    health = client.get(reverse("healthz"))
    assert health.status_code == 200 and health.content == b"ok\n"
    import plotly

    from portal.views import PLOTLY_JS

    plain = client.get(reverse("plotly-js"))
    assert b"".join(plain.streaming_content) == PLOTLY_JS.read_bytes()
    packed = client.get(reverse("plotly-js"), HTTP_ACCEPT_ENCODING="gzip, br")
    assert packed["Content-Encoding"] == "gzip"
    assert gzip.decompress(b"".join(packed.streaming_content)) == PLOTLY_JS.read_bytes()
    page = page_client(world, "admin").get(reverse("telemetry")).content.decode()
    assert f'src="/assets/plotly.min.js?v={plotly.__version__}"' in page
    assert "cdn" not in page.lower()


def test_drill_matrix_marks_a_missed_criterion(world: Any) -> None:
    drill = seed_drill()
    drill.result = {**drill.result, "orphaned_ports": [41234], "recovery_seconds": 120.0}
    drill.save(update_fields=["result"])
    body = page_client(world, "researcher").get(reverse("telemetry")).content.decode()
    matrix = body[body.index('id="mission-matrix"') :]
    matrix = matrix[: matrix.index("</table>")]
    rows = re.findall(r"<tr><td>([^<]+)</td>.*?<span class=\"pill (\w*)\">", matrix, re.S)
    assert ("Orphaned sockets", "bad") in rows
    assert ("Recovery time", "bad") in rows
    assert ("Checkpoint success rate", "ok") in rows


def test_rank_log_page_reads_the_runtime_log_in_parts(
    world: Any, history: Any, settings: Any, tmp_path: Any
) -> None:
    from preemption.runtimes.records import RANK_LOG

    settings.QM_RUNS_DIR = tmp_path
    settings.QM_RUNTIME = "local"
    victim = history.victim
    rank_dir = tmp_path / str(victim.pk) / "1" / "1"
    rank_dir.mkdir(parents=True)
    line = 'QM_EVENT {"event": "signal_received", "rank": 1}\n'
    (rank_dir / RANK_LOG).write_text("step 119 loss 0.25\n" + line)
    client = page_client(world, "other_researcher")
    body = client.get(reverse("rank-log", args=[victim.pk, 1, 1])).content.decode()
    assert "step 119 loss 0.25" in body
    assert "QM_EVENT {&quot;event&quot;: &quot;signal_received&quot;" in body
    raw = client.get(reverse("rank-log", args=[victim.pk, 1, 1]), {"raw": 1, "offset": 19})
    assert raw.content.decode() == line
    assert raw["X-Next-Offset"] == str(19 + len(line))
    missing = client.get(reverse("rank-log", args=[victim.pk, 7, 0]))
    assert missing.status_code == 404


def test_simulations_page_compares_stored_runs(world: Any) -> None:
    from simulation import Report
    from telemetry.models import SimulationRun

    summary = {"mean": 600.0, "p50": 500.0, "p99": 3600.0}
    runs = {}
    for policy, allocation in (("static", 0.61), ("fairshare", 0.87)):
        report = Report(
            run={"policy": policy, "jobs": 100, "jobs_completed": 98},
            simulated_seconds=86400.0,
            allocation={"overall": allocation},
            completion_time_seconds=summary,
            queueing_delay_seconds=summary,
            preemptions=7 if policy == "fairshare" else 0,
            lost_gpu_hours=1.5,
            longest_below_guarantee_line_seconds=42.0,
            teams={
                "vision": {
                    "gpu_hours_used": 120.0 if policy == "fairshare" else 80.0,
                    "gpu_hours_borrowed": 30.0,
                    "gpu_hours_lent": 5.0,
                }
            },
        )
        runs[policy] = SimulationRun.objects.create(
            policy=policy, trace="/data/openb_pod_list_default.csv", report=report.to_dict()
        )
    broken = SimulationRun.objects.create(policy="x", trace="", report={"not": "a report"})
    client = page_client(world, "researcher")
    body = client.get(reverse("simulations")).content.decode()
    for run in runs.values():
        assert f'data-run="{run.pk}"' in body
    assert f'data-run="{broken.pk}"' not in body
    comparison = json.loads(re.search(r'id="figure-comparison">(.*?)</script>', body, re.S)[1])
    allocations = dict(zip(comparison["data"][0]["x"], comparison["data"][0]["y"], strict=True))
    assert allocations == {
        f"#{runs['fairshare'].pk} fairshare": 0.87,
        f"#{runs['static'].pk} static": 0.61,
    }
    assert "openb_pod_list_default.csv" in body
    chosen = client.get(reverse("simulations"), {"run": runs["static"].pk}).content.decode()
    teams = json.loads(re.search(r'id="figure-teams">(.*?)</script>', chosen, re.S)[1])
    assert [trace["y"] for trace in teams["data"]] == [[80.0], [30.0], [5.0]]
    assert page_client(world, "anonymous").get(reverse("simulations")).status_code == 302


def test_job_page_says_how_many_retries_the_job_asked_for_and_used(world: Any) -> None:
    asked = builders.job(world, world.vision, retries=2, retries_used=1)
    none = builders.job(world, world.vision)
    client = page_client(world, "researcher")
    body = client.get(reverse("job-detail", args=[asked.pk])).content.decode()
    assert '<span data-field="retries">a failure is retried up to 2 times (1 used)</span>' in body
    body = client.get(reverse("job-detail", args=[none.pk])).content.decode()
    assert '<span data-field="retries">a failure is not retried</span>' in body

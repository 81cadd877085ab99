"""What a manager and an admin see in a real browser: the Nodes page after a node
is drained, with the over-commitment warning on the dashboard's flavor card and
the team list; the quota editor naming the allowed range for every bad value
typed; and its preview naming the running job a lower guarantee leaves beyond it."""

from __future__ import annotations

from typing import Any

import pytest

from quotas.models import AuditEntry, Node
from tests import builders
from tests.conftest import PASSWORD
from tests.e2e.conftest import Session

pytestmark = [
    pytest.mark.e2e,
    # Transactions, so the live server's thread sees the seeded rows; the
    # seeded priority classes of the migrations are restored after each test.
    pytest.mark.django_db(transaction=True, serialized_rollback=True),
]

WARNING = "24 GPUs of h100-80gb guaranteed, 16 schedulable: 8 drained on h100-node-2"


def test_a_manager_finds_the_drained_node_and_the_warning(
    world: Any, browser_session: Session
) -> None:
    node = Node.objects.get(name="h100-node-2")
    response = world.client("admin").patch(
        f"/api/v1/nodes/{node.pk}/", {"schedulable": False}, format="json"
    )
    assert response.status_code == 200
    session = browser_session
    page = session.page
    session.login("manager", PASSWORD)
    card = page.locator('article.card.flavor[data-flavor="h100-80gb"] .capacity-warning')
    assert WARNING in card.inner_text()
    assert card.is_visible()
    assert (
        page.locator('article.card.flavor[data-flavor="a100-40gb"] .capacity-warning').count() == 0
    )
    session.screenshot("dashboard-over-committed")
    page.click('nav.mainnav a:has-text("Nodes")')
    page.wait_for_load_state("networkidle")
    assert page.url.endswith("/nodes/")
    assert page.get_attribute('nav.mainnav a:has-text("Nodes")', "aria-current") == "page"
    drained = page.locator('tr[data-node="h100-node-2"] [data-field="state"]')
    assert drained.inner_text().strip() == "drained"
    assert page.locator(
        'tr[data-node="h100-node-0"] [data-field="state"]'
    ).inner_text().strip() == ("schedulable")
    assert WARNING in page.inner_text(".capacity-warning")
    # Read-only for a manager: no link to change a node.
    assert page.locator('#nodes a[href^="/admin/"]').count() == 0
    session.screenshot("nodes-drained")
    session.go("/teams/")
    assert WARNING in page.inner_text(".capacity-warning")
    assert session.console_errors == [] and session.foreign_requests == []


def test_a_researcher_has_no_nodes_link_and_an_admin_may_change_nodes(
    world: Any, browser_session: Session
) -> None:
    session = browser_session
    page = session.page
    session.login("researcher", PASSWORD)
    assert page.locator('nav.mainnav a:has-text("Nodes")').count() == 0
    page.context.clear_cookies()
    session.login("admin", PASSWORD)
    session.go("/nodes/")
    assert page.locator('#nodes a[href^="/admin/quotas/node/"]').count() == 4
    assert session.foreign_requests == []


@pytest.mark.parametrize("typed", ["-3", "1e20", "2.5", ""])
def test_the_editor_names_the_range_for_every_bad_value(
    world: Any, browser_session: Session, typed: str
) -> None:
    session = browser_session
    page = session.page
    session.login("manager", PASSWORD)
    quota = world.quota(world.vision)
    entries = AuditEntry.objects.count()
    session.go(f"/quotas/{quota.pk}/edit/")
    page.fill("#id_guarantee", "7")
    page.wait_for_selector("#preview-result")
    page.fill("#id_guarantee", typed)
    shown = typed or "nothing"
    message = (
        "Must be a whole number from 0 to 8: ml has 16 GPUs of h100-80gb and its other "
        f"sub-teams hold 8 (got {shown})."
    )
    page.wait_for_selector(".field.invalid p.error.live")
    assert page.inner_text(".field.invalid p.error.live") == message
    if typed == "-3":
        session.screenshot("quota-edit-range")
    page.click("#save-button")
    page.wait_for_load_state("networkidle")
    assert page.inner_text('p.error[data-error-for="guarantee"]') == message
    quota.refresh_from_db()
    assert (quota.guarantee, AuditEntry.objects.count()) == (8, entries)
    assert all("400" in error for error in session.console_errors)
    assert session.foreign_requests == []


def test_the_preview_names_the_job_a_lower_guarantee_leaves_beyond_it(
    world: Any, browser_session: Session
) -> None:
    job = builders.running_job(world, world.vision, name="big", ranks=1, gpus_per_rank=8)
    session = browser_session
    page = session.page
    session.login("manager", PASSWORD)
    session.go(f"/quotas/{world.quota(world.vision).pk}/edit/")
    page.fill("#id_guarantee", "4")
    page.wait_for_selector("#exposed")
    row = page.locator(f'#exposed tr[data-job="{job.pk}"]')
    assert row.locator('[data-field="beyond"]').inner_text() == "4"
    assert "first to be reclaimed when an owner needs them" in row.inner_text()
    assert "1 running job would run beyond the guarantee" in page.inner_text("#exposed-head")
    session.screenshot("quota-preview-exposed")
    assert session.console_errors == [] and session.foreign_requests == []

"""The drill's set-up: its flavor, nodes, teams, quotas and priority classes, made
through the quotas services as the `drill-bot` user, and the clearing of an earlier
drill's leftovers. Runs no job and measures nothing.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError

from drills.base import FLAVOR, DrillBase, DrillError
from preemption.models import FINAL_STATES, Job
from preemption.services import job_cancel
from quotas.models import Node, PriorityClass, Quota, ResourceFlavor, Team
from quotas.services import (
    flavor_create,
    node_upsert,
    priority_class_save,
    quota_set,
    team_create,
    team_priority_classes_set,
)


class DrillSetup(DrillBase):
    """Creates (or reuses) what a drill runs on."""

    # -- set-up ----------------------------------------------------------------

    def setup(self) -> None:
        """Create (or reuse) the drill's flavor, nodes, teams, classes and user.

        Every change goes through the quotas services as `drill-bot`, so it is
        validated and audited; what is already as wanted is left alone (and not
        audited again)."""
        user_model = get_user_model()
        self.user = user_model.objects.filter(
            username="drill-bot"
        ).first() or user_model.objects.create_user("drill-bot", "drill@example.org", None)
        try:
            self._setup_cluster(self.user)
        except ValidationError as error:
            raise DrillError(f"the drill's set-up was refused: {error}") from error
        self._clear_leftovers()

    def _setup_cluster(self, actor: AbstractBaseUser) -> None:
        flavor = ResourceFlavor.objects.filter(name=FLAVOR).first() or flavor_create(
            actor=actor, name=FLAVOR, description="drill GPUs"
        )
        wanted = {f"drill-node-{i}" for i in range(self.nodes)}
        for node in Node.objects.filter(flavor=flavor, schedulable=True).exclude(name__in=wanted):
            node_upsert(
                actor=actor,
                name=node.name,
                flavor=flavor,
                gpus=node.gpus,
                labels=node.labels,
                schedulable=False,
            )
        for name in sorted(wanted):
            gpus = self.gpus_per_node
            if not Node.objects.filter(
                name=name, flavor=flavor, gpus=gpus, schedulable=True
            ).exists():
                node_upsert(actor=actor, name=name, flavor=flavor, gpus=gpus, schedulable=True)
        root = Team.objects.filter(slug="drill").first() or team_create(
            actor=actor, slug="drill", name="Drill"
        )
        owner = Team.objects.filter(slug="drill-owner").first() or team_create(
            actor=actor, slug="drill-owner", name="Drill owner", parent=root
        )
        borrower = Team.objects.filter(slug="drill-borrower").first() or team_create(
            actor=actor, slug="drill-borrower", name="Drill borrower", parent=root
        )
        self._set_quotas(actor=actor, flavor=flavor, root=root, owner=owner, borrower=borrower)
        self.flavor, self.owner, self.borrower = flavor, owner, borrower
        self.batch = PriorityClass.objects.get(name="ai-batch-preemptible")
        self.critical = PriorityClass.objects.get(name="ai-prod-critical")
        self.short_grace = self._priority_class(
            actor=actor,
            name="drill-short-grace",
            grace_seconds=1,
            notice_seconds=0,
            description="Drill only: a grace shorter than a checkpoint save.",
        )
        self.classes = {True: self.batch, False: self._without_notice(actor, self.batch)}
        if self.grace is not None:
            grace = max(1, int(self.grace))
            self.classes = {
                True: self._priority_class(
                    actor=actor,
                    name="drill-grace",
                    grace_seconds=grace,
                    notice_seconds=min(30, grace // 2),
                    description="Drill only: --grace",
                ),
                False: self._priority_class(
                    actor=actor,
                    name="drill-grace-no-notice",
                    grace_seconds=grace,
                    notice_seconds=0,
                    description="Drill only: --grace, no checkpoint notice",
                ),
            }
        # The owner runs the critical job, the borrower the preemptible ones; the
        # root must hold every class its sub-teams narrow to, so it is set first.
        for team, classes in (
            (root, [self.critical, self.batch, self.short_grace, *self.classes.values()]),
            (owner, [self.critical]),
            (borrower, [self.batch, self.short_grace, *self.classes.values()]),
        ):
            if set(team.priority_classes.all()) != set(classes):
                team_priority_classes_set(
                    actor=actor, team=team, priority_classes=classes, may_widen=True
                )

    def _set_quotas(
        self,
        *,
        actor: AbstractBaseUser,
        flavor: ResourceFlavor,
        root: Team,
        owner: Team,
        borrower: Team,
    ) -> None:
        """The owner is guaranteed every drill GPU and the borrower none, so all the
        borrower runs is borrowed. The changes come in an order that keeps every
        sum rule true at each step: sub-teams first make room under the root for
        its new size, then the root, then the owner."""
        current = {
            quota.team_id: quota
            for quota in Quota.objects.filter(flavor=flavor, team__in=[root, owner, borrower])
        }
        borrower_quota = current.get(borrower.pk)
        if (
            borrower_quota is None
            or borrower_quota.guarantee
            or borrower_quota.borrow_limit is not None
        ):
            quota_set(actor=actor, team=borrower, flavor=flavor, guarantee=0)
        owner_quota = current.get(owner.pk)
        if owner_quota is not None and owner_quota.guarantee > self.capacity:
            quota_set(actor=actor, team=owner, flavor=flavor, guarantee=self.capacity)
        quota_set(actor=actor, team=root, flavor=flavor, guarantee=self.capacity)
        quota_set(actor=actor, team=owner, flavor=flavor, guarantee=self.capacity)

    def _without_notice(self, actor: AbstractBaseUser, like: PriorityClass) -> PriorityClass:
        """The borrower's class with its grace window and no checkpoint notice."""
        return self._priority_class(
            actor=actor,
            name="drill-no-notice",
            grace_seconds=like.grace_seconds,
            notice_seconds=0,
            description=f"Drill only: {like.name} without the checkpoint notice",
        )

    @staticmethod
    def _priority_class(
        *,
        actor: AbstractBaseUser,
        name: str,
        grace_seconds: int,
        notice_seconds: int,
        description: str,
    ) -> PriorityClass:
        """A preemptible class of the drill's own with the given grace and notice
        windows, saved (and audited) only when it is new or differs."""
        wanted = {
            "value": 10_000,
            "preemption_policy": "Never",
            "preemptible": True,
            "grace_seconds": grace_seconds,
            "notice_seconds": notice_seconds,
            "description": description,
        }
        priority_class = PriorityClass.objects.filter(name=name).first() or PriorityClass(name=name)
        if priority_class.pk and all(getattr(priority_class, k) == v for k, v in wanted.items()):
            return priority_class
        for key, value in wanted.items():
            setattr(priority_class, key, value)
        return priority_class_save(actor=actor, priority_class=priority_class)

    def _clear_leftovers(self) -> None:
        for job in Job.objects.filter(team__in=[self.owner, self.borrower]).exclude(
            state__in=FINAL_STATES
        ):
            job_cancel(actor=self.user, job=job)
        self.wait(
            lambda: (
                not Job.objects.filter(team__in=[self.owner, self.borrower])
                .exclude(state__in=FINAL_STATES)
                .exists()
            ),
            "earlier drill jobs to stop",
            timeout=180,
            quiet=True,
        )

"""The mission's targets, defined once.

Graceful preemption is judged by three figures: the signal reaches every rank
of a gang within 1.2 s of the decision; the checkpoint is committed inside the
preempted job's grace window; and a preempted job resumes within 90 s once its
GPUs are free again. The drill checks them, the telemetry page's mission matrix
and its charts draw them, and `/metrics` puts a histogram bucket on the signal
target; all of them read the figures and the tests here.

Pure Python with no Django import, so every layer may use it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MissionTargets:
    """What a graceful preemption must achieve, with the test for each figure."""

    # Preemption decision -> the slowest rank's `signal_received`, strictly below.
    signal_propagation_seconds: float = 1.2
    # The GPUs are free again (the preemptor's last rank exited) -> the victim's
    # `resumed`, strictly below.
    recovery_seconds: float = 90.0
    # The checkpoint must take at most this share of the grace window: all of it,
    # since SIGKILL follows at the deadline.
    checkpoint_share_of_grace: float = 1.0
    # With the checkpoint notice, a preemption loses under this share of the work
    # (GPU-seconds since the last committed checkpoint when the ranks stop) that the
    # same preemption loses without it.
    notice_lost_work_share: float = 0.05
    # ... and frees the GPUs no later than without it, give or take one reconcile
    # pass and a step boundary (measured on a busy machine).
    notice_time_to_free_slack_seconds: float = 1.0

    def signal_met(self, seconds: float) -> bool:
        return seconds < self.signal_propagation_seconds

    def recovery_met(self, seconds: float) -> bool:
        return seconds < self.recovery_seconds

    def checkpoint_met(self, checkpoint_seconds: float, grace_seconds: float) -> bool:
        return checkpoint_seconds <= grace_seconds * self.checkpoint_share_of_grace

    def notice_lost_work_met(self, with_notice: float, without: float) -> bool:
        if without <= 0:
            return with_notice <= 0
        return with_notice < without * self.notice_lost_work_share

    def notice_time_to_free_met(self, with_notice: float, without: float) -> bool:
        return with_notice <= without + self.notice_time_to_free_slack_seconds

    @property
    def notice_lost_work_text(self) -> str:
        return f"under {self.notice_lost_work_share:.0%} of the work lost without the notice"

    @property
    def notice_time_to_free_text(self) -> str:
        return (
            f"no later than without the notice "
            f"(+{self.notice_time_to_free_slack_seconds:g} s for one reconcile pass)"
        )

    @property
    def signal_text(self) -> str:
        return f"max under {self.signal_propagation_seconds:g} s"

    @property
    def recovery_text(self) -> str:
        return f"under {self.recovery_seconds:g} s"

    @property
    def checkpoint_text(self) -> str:
        if self.checkpoint_share_of_grace == 1.0:
            return "checkpoint seconds ≤ grace seconds"
        return f"checkpoint seconds ≤ {self.checkpoint_share_of_grace:.0%} of the grace seconds"


MISSION = MissionTargets()

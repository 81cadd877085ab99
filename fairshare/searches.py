"""The preemption searches of one flavor's planner: which kinds of preemption could let
a workload in, the searches over the candidates of the whole flavor or of one topology
domain, the memos that spare searches known to fail, and until when victims that
their minimum runtime protects keep a workload waiting.

``FlavorSearches`` builds on ``decisions.FlavorDecisions`` (the state, and the
decisions a successful search records); ``cycle.FlavorPlanner`` builds on it. Searches
and takes victims; never chooses which workload is planned next.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

from .decisions import FlavorDecisions, jobs_phrase
from .model import FAIR_SHARE, PREEMPT_LOWER_PRIORITY, PRIORITY, RECLAIM
from .nodes import Placement
from .preemption import Victims, preempt_for
from .rules import r6_may_reclaim
from .work import PendingJob, RunningWork

# Topology domains a gang that needs one searches for victims, per kind of preemption.
DOMAIN_SEARCHES_PER_MODE = 2


def _in_domain(
    candidates: Iterator[tuple[RunningWork, str]], domain_of: list[str | None], name: str
) -> Iterator[tuple[RunningWork, str]]:
    """The candidates that run in domain ``name``, one at a time as ``candidates`` yield.

    A generator function, not a generator expression: compiled by mypyc, a generator
    expression is built as a whole list first, while a victim scan judges each
    candidate by the usage that the victims taken before it left (R3 in
    ``VictimCandidates.reclaim``), so it must run only as far as the victims are taken.
    """
    for run, reason in candidates:
        if any(domain_of[node] == name for node, _ in run.nodes):
            yield run, reason


class FlavorSearches(FlavorDecisions):
    """The preemption searches of one flavor's planner."""

    def _plan_in_one_domain(self, job: PendingJob) -> bool:
        """Place ``job`` with all its ranks inside one domain of its topology level.

        Free GPUs first, in the domain with the least room that fits the gang, so that
        whole domains stay free for larger gangs; then GPUs being released; then
        victims, searched domain by domain so that the GPUs they free lie together
        (a search over the whole cluster frees GPUs scattered over domains that no
        gang of this kind can use), the domain with the cheapest victims winning.
        Returns whether the job was admitted, reserved or took victims.
        """
        workload = job.workload
        nodes = self.nodes
        ranks = workload.ranks
        gpus_per_rank = workload.gpus_per_rank
        level = workload.topology_level or ""
        domains = nodes.domains.get(level, {})
        free = nodes.free
        # Free GPUs only shrink until the cache is cleared: a gang of as many ranks or
        # more that found no domain finds none again.
        shape = (level, gpus_per_rank)
        known_failure = nodes.unplaceable_in_domain.get(shape)
        if known_failure is None or ranks < known_failure:
            fitting: list[tuple[int, str, Placement]] = []
            for name, members in domains.items():
                placement = nodes.place_in(members, ranks, gpus_per_rank, releasing=False)
                if placement is not None:
                    fitting.append((sum(free[node] for node in members), name, placement))
            if fitting:
                self._admit(job, min(fitting)[2])
                return True
            nodes.unplaceable_in_domain[shape] = min(ranks, known_failure or ranks)
        known_failure = self.unplaceable_in_domain_releasing.get(shape)
        if nodes.releasing_nodes and (known_failure is None or ranks < known_failure):
            for _name, members in sorted(domains.items()):
                placement = nodes.place_in(members, ranks, gpus_per_rank)
                if placement is not None:
                    self._wait_on(job, placement)
                    return True
            self.unplaceable_in_domain_releasing[shape] = min(ranks, known_failure or ranks)
        modes = self._modes(job)
        if modes:
            job.attempted_at_version = self.candidates_version
        failed_attempts = self.failed_attempts
        for mode in modes:
            value = job.priority_class.value if mode == PRIORITY else 0
            # The kinds of failed attempts of _plan_job, per topology level.
            attempt = (
                job.queue,
                f"{mode}@{level}",
                gpus_per_rank,
                value,
                job.priority_class.preemptible,
            )
            failed = failed_attempts.get(attempt)
            if failed is not None and failed[1] == self.candidates_version and ranks >= failed[0]:
                continue
            best: tuple[tuple[float, float, str], str] | None = None
            # The best search's victims and placement while their quota usage is still
            # taken: given back before the next search, which must start from the same
            # ledger, and searched again only if a later domain came in between.
            held: tuple[Victims, Placement] | None = None
            # Each search is a scan over the candidates: try the domains with the most
            # room for ranks once their preemptible work is gone, a few of them.
            for name in nodes.roomiest_domains(
                level, gpus_per_rank, self.preemptible_on_node, DOMAIN_SEARCHES_PER_MODE
            ):
                if mode == FAIR_SHARE and self._known_dry(job):
                    # No candidate in the whole cluster, so none in any domain either.
                    break
                if held is not None:
                    self._give_back(held[0])
                    held = None
                found = self._search_domain(job, mode, level, name)
                if found is None:
                    continue
                victims, _ = found
                cost = (
                    float(max(run.priority_class.value for run, _ in victims)),
                    sum(run.lost for run, _ in victims),
                    name,
                )
                if best is None or cost < best[0]:
                    best = (cost, name)
                    held = found
                else:
                    self._give_back(victims)
            if best is None:
                failed_attempts[attempt] = (ranks, self.candidates_version)
                continue
            if held is None:
                held = self._search_domain(job, mode, level, best[1])
            if held is not None:
                self._take(job, *held)
                return True
        return False

    def _search_domain(
        self, job: PendingJob, mode: str, level: str, name: str
    ) -> tuple[Victims, Placement] | None:
        """``preempt_for`` with ``mode``'s candidates that run in domain ``name`` of
        ``level``, placing ``job`` inside that domain."""
        return self._search(
            job,
            mode,
            _in_domain(self._candidates(job, mode), self.nodes.domain_of[level], name),
            self.nodes.domains[level][name],
        )

    def _search(
        self,
        job: PendingJob,
        mode: str,
        candidates: Iterator[tuple[RunningWork, str]],
        domain: list[int] | None = None,
    ) -> tuple[Victims, Placement] | None:
        """``preempt_for`` over ``mode``'s ``candidates`` (those in ``domain`` when one is
        given). A fair-share search that met no candidate at all, protected or not,
        marks the queue dry (``_note_dry``): with a domain too, as the candidates it
        filters are the whole cluster's."""
        offered = self.victims.fair_share_offered
        protected = len(self.victims.protected)
        found = preempt_for(self.ledger, self.nodes, job, candidates, domain)
        if (
            found is None
            and mode == FAIR_SHARE
            and self.victims.fair_share_offered == offered
            and len(self.victims.protected) == protected
        ):
            self._note_dry(job)
        return found

    def _known_dry(self, job: PendingJob) -> bool:
        """Whether a fair-share search for ``job`` is known to find no candidate at all
        (see ``fair_share_dry``)."""
        dry = self.fair_share_dry.get(job.queue)
        return dry is not None and dry[1] == self.candidates_version and job.gpus >= dry[0]

    def _note_dry(self, job: PendingJob) -> None:
        """Record that a fair-share search for ``job`` found no candidate, protected or
        not: R8 only gets harder for more GPUs, so no job of the queue that large or
        larger finds one either while the candidates stay the same, whatever its shape
        or topology."""
        dry = self.fair_share_dry.get(job.queue)
        if dry is None or dry[1] != self.candidates_version or job.gpus < dry[0]:
            self.fair_share_dry[job.queue] = (job.gpus, self.candidates_version)

    def _give_back(self, victims: Victims) -> None:
        """Undo the quota usage a successful ``preempt_for`` left taken for ``victims``."""
        for run, _ in victims:
            self.ledger.add_usage(run.queue, run.gpus)

    def _candidates(
        self, job: PendingJob, mode: str, reclaimed: list[tuple[RunningWork, str]] | None = None
    ) -> Iterator[tuple[RunningWork, str]]:
        if mode == RECLAIM:
            return self.victims.reclaim(job.queue)
        if mode == PRIORITY:
            return self.victims.priority(job, reclaimed)
        return self.victims.fair_share(job)

    def _protected_until(self, job: PendingJob, modes: list[str]) -> tuple[str, float | None]:
        """Until when the victims that would let ``job`` in are protected, in words and
        as a moment, or ("", None).

        Asked only of a workload that found no victims while some candidates were passed
        over for their minimum runtime: its searches run again with that protection
        ignored, and when they succeed the waiting reason names the protected victims
        and the moment the last of them may go. The searches' tentative quota changes
        are undone; a plan runs a bounded number of them, and workloads of one kind
        share the answer while the candidates stay the same.
        """
        victims = self.victims
        workload = job.workload
        kind = (
            job.queue,
            workload.ranks,
            workload.gpus_per_rank,
            job.priority_class.value,
            job.priority_class.preemptible,
        )
        version = (self.candidates_version, len(self.preempt))
        known = self.protection_by_kind.get(kind)
        if known is not None and known[0] == version:
            return known[1]
        if not victims.protected or self.protection_searches_left <= 0:
            return "", None
        self.protection_searches_left -= 1
        self.changes += 1
        victims.ignore_protection = True
        try:
            found = None
            for mode in modes:
                found = preempt_for(self.ledger, self.nodes, job, self._candidates(job, mode))
                if found is not None:
                    break
        finally:
            victims.ignore_protection = False
        phrase = ""
        moment_at: float | None = None
        if found is not None:
            chosen, _ = found
            for run, _ in chosen:
                # preempt_for leaves its victims' quota usage taken: give it back.
                self.ledger.add_usage(run.queue, run.gpus)
            protected = [
                (run, reason, self.now - run.runtime + run.minimum[reason])
                for run, reason in chosen
                if run.runtime < run.minimum[reason]
            ]
            if protected:
                until = max(at for _, _, at in protected)
                moment_at = until
                ids = [run.workload.id for run, _, _ in protected]
                reasons = sorted({reason for _, reason, _ in protected})
                moment = datetime.fromtimestamp(until, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
                phrase = (
                    f"{jobs_phrase(ids)} may be preempted ({', '.join(reasons)}) only after "
                    f"their minimum runtime, at {moment} (in {until - self.now:.0f} s)"
                )
        self.protection_by_kind[kind] = (version, (phrase, moment_at))
        return phrase, moment_at

    def _modes(self, job: PendingJob) -> list[str]:
        """The kinds of preemption that could let ``job`` in: reclaim, priority, fair share."""
        queue = job.queue
        gpus = job.gpus
        ledger = self.ledger
        modes: list[str] = []
        # Victims of other queues never lower this queue's own borrowing, so a
        # non-preemptible job beyond its guarantee can only gain from priority (R5).
        within_guarantee = ledger.pinned_usage[queue] + gpus <= ledger.guarantee[queue]
        if r6_may_reclaim(ledger.usage[queue], gpus, ledger.guarantee[queue]):
            modes.append(RECLAIM)
        runs = self.victims.by_queue[queue]
        first = self.victims.first_live_index(queue)
        if (
            job.priority_class.preemption_policy == PREEMPT_LOWER_PRIORITY
            and first < len(runs)
            and runs[first].priority_class.value < job.priority_class.value
        ):
            modes.append(PRIORITY)
        if ledger.usage[queue] < ledger.fair_share[queue] and (
            job.priority_class.preemptible or within_guarantee
        ):
            modes.append(FAIR_SHARE)
        return modes

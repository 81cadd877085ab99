"""The order of one flavor's pending work: the key of each queue in a pass's heap.

Decides where the next job of a queue stands: work inside every guarantee on its path
(or inside an ancestor's unheld part) first, work inside its queue's own guarantee but
beyond an ancestor's next, the rest last; inside the first two, work that fits inside
its queue's own guarantee by age across queues, then by how far the queue stands below
its fair share (weighed by its recent usage). ``FlavorOrder`` builds on the preemption
searches (``searches.py``); ``cycle.FlavorPlanner`` builds on it and runs the passes.
Orders queues; never plans a job.
"""

from __future__ import annotations

from .searches import FlavorSearches
from .work import INSIDE_OWN_GUARANTEE, PendingJob, QueueKey


class FlavorOrder(FlavorSearches):
    """The keys that order one flavor's queues in a pass."""

    def _queue_key(self, queue: int, head: PendingJob) -> QueueKey:
        # Work that fits inside its queue's guarantee goes before any borrowing: otherwise
        # a borrower would take GPUs that the guarantee reclaims in the next cycle.
        #
        # Among work inside its own queue's guarantee, the older submission goes first,
        # whichever queue is further below its fair share. A guarantee promises each job
        # that fits in it a start within one cycle and a grace window, and such a job
        # reclaims its own victims when it is planned. Ordered by fair share, a queue with a stream of
        # jobs far below its share went first in every plan: each GPU freed by another
        # team's victim went to the stream's newest job, and the older job it was freed
        # for only claimed GPUs still being released, again and again, for as long as
        # the stream lasted. Ordered by age, each plan hands the GPUs freed (and those
        # being released) to the jobs that reclaimed first, so the capacity freed for a
        # job stays with it across cycles without a reservation the snapshot would have
        # to carry; this is the job-age order of Slurm's multifactor priority and the
        # FIFO order of Kueue's queues, applied to the promise. A job waits only for the
        # older work inside guarantees, whose victims were chosen no later than its own.
        #
        # Other work goes by the queue furthest below its fair share, the distance weighed
        # by how little it used recently (decayed usage); ties by older submission. That
        # includes work beyond its queue's guarantee that fits in the part of an
        # ancestor's guarantee no sibling uses or holds (rank 0, see _beyond_guarantee),
        # which comes after the work inside own guarantees: the promise is the queue's.
        return QueueKey(
            self._guarantee_rank(queue, head.gpus),
            self._order_distance(queue, head.gpus),
            head.workload.submitted_at,
            self.tree.names[queue],
            queue,
        )

    def _order_distance(self, queue: int, gpus: int) -> float:
        """The second part of a queue's key when its next job takes ``gpus`` GPUs (see
        _queue_key)."""
        ledger = self.ledger
        usage = ledger.usage[queue]
        if usage + gpus <= ledger.guarantee[queue]:
            return INSIDE_OWN_GUARANTEE
        below = usage - ledger.fair_share[queue]
        return below * ledger.order_boost[queue] if below < 0 else below

    def _guarantee_rank(self, queue: int, gpus: int) -> int:
        """Where ``gpus`` more for ``queue`` stand in the order: 0 inside every
        guarantee on its path (or inside an ancestor's unheld part, see
        _beyond_guarantee), 1 inside the queue's own guarantee but beyond an
        ancestor's, 2 beyond every guarantee.

        A job inside its own guarantee can still take an ancestor beyond the ancestor's
        guarantee when a sibling borrows that guarantee. Planned before another team's
        job that fits inside all of its guarantees, it would take the free GPUs that
        job needs; the other team could reclaim the sibling's borrowed work only in the
        next cycle, once the new job runs (an admit-then-reclaim flap). Planned after
        it, the job finds too few free GPUs and reclaims its sibling's work itself, in
        this plan.
        """
        usage = self.ledger.usage
        guarantee = self.ledger.guarantee
        if usage[queue] + gpus <= guarantee[queue]:
            parent = self.tree.parent
            above = parent[queue]
            while above >= 0:
                if usage[above] + gpus > guarantee[above]:
                    return 1
                above = parent[above]
            return 0
        return 2 if self._beyond_guarantee(queue, gpus) else 0

    def _beyond_guarantee(self, queue: int, gpus: int) -> bool:
        """Whether ``gpus`` more would take ``queue`` beyond every guarantee on its path.

        A job beyond its own queue's guarantee may still fit inside an ancestor's, in the
        part that the ancestor's other children neither use nor hold as their own
        guarantee. It then counts as inside: planned after another team's borrowing, it
        would take that borrowing back by reclaim or fair share in the next cycle, once
        the borrower runs (an admit-then-preempt flap).
        """
        usage = self.ledger.usage
        guarantee = self.ledger.guarantee
        parent = self.tree.parent
        children = self.tree.children
        child = queue
        above = parent[queue]
        while above >= 0:
            # The ancestor's own usage counts its children's, so the job fits nowhere
            # inside a guarantee that it would exceed; most ancestors of a full cluster
            # stop here without looking at the siblings.
            room = guarantee[above] - gpus
            if usage[above] <= room:
                held = usage[child]
                for other in children[above]:
                    if other != child:
                        held += max(guarantee[other], usage[other])
                if held <= room:
                    return False
            child = above
            above = parent[above]
        return True

"""Status: every queue's standing for one flavor once the plan is made.

Decides what each queue is shown to hold: its guarantee, its usage (running,
terminating and newly admitted GPUs, a resized elastic gang at its new size), its fair share, what it borrows beyond its
guarantee, and how much of its idle guarantee other queues use (R4's lending, shared
out between siblings in proportion to what each could lend).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .ledger import QuotaLedger
from .model import PENDING, QueueStatus, Workload
from .rules import r4_lendable_idle


def queue_statuses(
    ledger: QuotaLedger,
    workloads: Sequence[Workload],
    admitted: Iterable[tuple[int, int]],
    resized: Iterable[tuple[int, int]] = (),
) -> dict[int, QueueStatus]:
    """Every queue's status after the plan; ``admitted`` lists (queue, GPUs) of new
    admissions, ``resized`` (queue, GPUs) of running elastic gangs grown (fewer when
    negative: shrunk), which count at their new size."""
    tree = ledger.tree
    guarantee = ledger.guarantee
    count = len(tree.names)
    held = [0] * count
    for workload in workloads:
        if workload.state != PENDING:
            held[tree.index[workload.queue]] += workload.gpus
    for queue, gpus in admitted:
        held[queue] += gpus
    for queue, gpus in resized:
        held[queue] += gpus
    for queue in tree.bottom_up:
        parent = tree.parent[queue]
        if parent != -1:
            held[parent] += held[queue]
    lent = [0.0] * count
    top_spare = max(0, ledger.capacity - sum(guarantee[top] for top in tree.top))
    # Each group of siblings with the parent's unassigned guarantee and what the parent
    # lends outward, parents before children (a list of work rather than a recursive
    # inner function, which would hold itself and the ledger in a reference cycle).
    groups: list[tuple[list[int], float, float]] = [(tree.top, float(top_spare), 0.0)]
    while groups:
        siblings, spare, outward = groups.pop()
        # Borrowers among the siblings use the parent's unassigned guarantee first,
        # then the siblings' idle guarantees; what the parent lends outward comes
        # from its children's idle guarantees too.
        borrowed = sum(max(0, held[s] - guarantee[s]) for s in siblings)
        need = max(0.0, borrowed - spare) + outward
        idle = [
            float(r4_lendable_idle(guarantee[s], held[s], ledger.lend_limit[s])) for s in siblings
        ]
        total_idle = sum(idle)
        for sibling, lendable in zip(siblings, idle, strict=True):
            lent[sibling] = 0.0 if total_idle <= 0 else min(lendable, need * lendable / total_idle)
        for sibling in siblings:
            children = tree.children[sibling]
            if children:
                unassigned = max(0, guarantee[sibling] - sum(guarantee[c] for c in children))
                groups.append((children, float(unassigned), lent[sibling]))
    return {
        queue: QueueStatus(
            guarantee=guarantee[queue],
            usage=held[queue],
            fair_share=round(ledger.fair_share[queue], 6),
            borrowed=max(0, held[queue] - guarantee[queue]),
            lent=round(lent[queue]),
            weight_fair_share=round(ledger.plain_fair_share[queue], 6),
            usage_ratio=round(ledger.usage_ratio[queue], 6),
        )
        for queue in range(count)
    }

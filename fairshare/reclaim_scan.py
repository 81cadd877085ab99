"""What a reclaim scan keeps while it runs: where it stands among the donor queues
(``ReclaimScan``), which parents close the guarantee line to it (``closed_below_lca``,
which the fair-share scans read too), and the candidates it yielded, kept for the
priority search that may follow a failed one (``ReclaimStream``).

Holds the scans' state only; the scans themselves, and the rules they apply, are
``VictimCandidates``' (``candidates.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

from .ledger import QuotaLedger
from .tree import LcaChain, QueueTree
from .work import RunningWork


def closed_below_lca(
    tree: QueueTree,
    queue: int,
    held: list[int],
    ledger: QuotaLedger,
    without_planned: bool,
) -> list[bool]:
    """Per queue with children: whether it or one of its ancestors, below the lowest
    common ancestor with ``queue``, holds at most its guarantee line; ``held`` is every
    queue's usage, less the GPUs of its own work admitted in this plan with
    ``without_planned``, and less the GPUs reserved for its waiting jobs in both cases.

    A donor whose parent is closed so gives nothing to ``queue`` (R3: every queue on its
    chain up to the common ancestor must stay above its line). A full cluster has
    hundreds of donors under a few dozen parents, and a victim scan judges every
    donor it meets: judging each parent once per scan spares walking every donor's
    chain (on the engine benchmark's running-heavy cluster, 700,000 chains a plan).
    """
    waiting = ledger.waiting_usage
    planned = ledger.planned_usage
    line = ledger.line
    parent = tree.parent
    children = tree.children
    # The queues with children on ``queue``'s path, top first: they come in this order
    # in ``inner_top_down`` too, so each is met by looking at the next one only
    # (compiled, a dict lookup for every parent made an int object for the key).
    on_path = [x for x in reversed(tree.path[queue]) if children[x]]
    next_on_path = 0
    closed = [False] * len(parent)
    for x in tree.inner_top_down:
        if next_on_path < len(on_path) and x == on_path[next_on_path]:
            next_on_path += 1
            continue
        left = held[x] - waiting[x]
        if without_planned:
            left -= planned[x]
        above = parent[x]
        closed[x] = left <= line[x] or (above != -1 and closed[above])
    return closed


class ReclaimStream:
    """The candidates a reclaim scan yields, kept as it yields them.

    A workload whose reclaim search fails then tries a priority search, whose
    candidates are its own queue's lower work followed by the very same reclaim scan
    (``VictimCandidates.priority``). Nothing that scan reads changes in between: a
    failed search gives back every change it made, and the priority candidates taken
    first lower only the usage of the preemptor's queue and its ancestors, while the
    scan reads the usage of the donors and of their ancestors below the common
    ancestor. So the priority search reads the kept candidates again; on a saturated
    cluster the scan was the larger part of the searches that fail.

    The kept candidates stand for the whole scan only when the search read it to its
    end (``ended``) or up to its cap (``MAX_CANDIDATES_PER_ATTEMPT`` + 1 read), which
    ``complete`` says.
    """

    __slots__ = ("ended", "items")

    def __init__(self) -> None:
        self.items: list[tuple[RunningWork, str]] = []
        self.ended = False

    def record(self, scan: Iterator[tuple[RunningWork, str]]) -> Iterator[tuple[RunningWork, str]]:
        """``scan``'s candidates, each kept before it is yielded."""
        items = self.items
        for item in scan:
            items.append(item)
            yield item
        self.ended = True

    def complete(self, cap: int) -> bool:
        """Whether the kept candidates are all a search with ``cap`` can read."""
        return self.ended or len(self.items) > cap


class ReclaimScan:
    """Where one reclaim scan stands among the donor queues (see
    ``VictimCandidates.reclaim``): a class rather than closures over the scan's
    locals, so that the compiled scan calls its helpers directly."""

    __slots__ = (
        "chains",
        "closed",
        "closed_running",
        "frontier",
        "heads",
        "lca_row",
        "position",
        "queue",
        "start_usage",
    )

    def __init__(
        self,
        queue: int,
        lca_row: list[LcaChain | None],
        start_usage: list[int],
        heads: list[tuple[object, ...]],
    ) -> None:
        # The reclaiming queue.
        self.queue = queue
        self.lca_row = lca_row
        # Every queue's usage when the scan began.
        self.start_usage = start_usage
        # closed_below_lca with that usage, for donors with work admitted in this plan
        # and for donors with only running work to give; made when first needed.
        self.closed: list[bool] | None = None
        self.closed_running: list[bool] | None = None
        # The donor heads as they stood when the scan began, cheapest first; the scan
        # has looked at those before ``position``, and ``frontier`` is the last of them
        # it admitted (-1: none left).
        self.heads = heads
        self.position = 0
        self.frontier = -1
        # Per donor admitted: its queues up to the common ancestor with ``queue``.
        self.chains: dict[int, tuple[int, ...]] = {}

    def closed_below(self, tree: QueueTree, ledger: QuotaLedger, only_running: bool) -> list[bool]:
        """``closed_below_lca`` as the ledger stood when the scan began, for donors with
        only running work to give or not; made once per scan."""
        if only_running:
            if self.closed_running is None:
                self.closed_running = closed_below_lca(
                    tree, self.queue, self.start_usage, ledger, True
                )
            return self.closed_running
        if self.closed is None:
            self.closed = closed_below_lca(tree, self.queue, self.start_usage, ledger, False)
        return self.closed

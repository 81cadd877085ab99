"""The physical nodes of one flavor: where a gang's ranks can go.

Decides placements (R10: best fit for a gang that fits one node, else the nodes with the
most room first) on the GPUs that are free now, or on free GPUs plus those on their way
back from terminating victims (R1: a victim holds its GPUs until it exits; R11: a
preemptor counts releasing GPUs before it picks victims), and reserves a placement for a
preemptor that waits for it.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence

from .model import Node
from .rules import r1_capacity_free_gpus, r10_place, r11_releasing_first

# A placement: (node index, ranks on that node) pairs.
Placement = list[tuple[int, int]]


@dataclasses.dataclass
class DomainRooms:
    """The room in ranks of one size per domain of one topology level, as of
    ``seen`` changes of the node map, and the roomiest domains found from it."""

    rooms: dict[str, int]
    seen: int
    roomiest: list[str] = dataclasses.field(default_factory=list)


class NodeMap:
    """Free and releasing GPUs per node of one flavor, kept current by the plan."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        """The flavor's ``nodes``, all free until ``occupy`` says what is held."""
        self.names: list[str] = [node.name for node in nodes]
        # Per topology level: its domains, each with its node indices.
        self.domains: dict[str, dict[str, list[int]]] = {}
        # Per topology level: each node's domain (None where the node has no such level).
        self.domain_of: dict[str, list[str | None]] = {}
        for i, node in enumerate(nodes):
            for level, domain in node.topology.items():
                self.domains.setdefault(level, {}).setdefault(domain, []).append(i)
                self.domain_of.setdefault(level, [None] * len(nodes))[i] = domain
        self.gpus: list[int] = [node.gpus for node in nodes]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.capacity = sum(self.gpus)
        self.max_node_gpus = max(self.gpus, default=0)
        self.free = list(self.gpus)
        # The nodes grouped by how many GPUs they have free, for best-fit placement
        # without a scan over every node.
        self.by_free_gpus: list[dict[int, None]] = [{} for _ in range(self.max_node_gpus + 1)]
        self.free_total = 0
        # GPUs on their way back from terminating victims, per node, and whose they are:
        # (job, its GPUs not yet claimed), in the order claims take them.
        self.releasing = [0] * len(self.names)
        self.releasing_jobs: list[list[tuple[str, int]]] = [[] for _ in self.names]
        self.releasing_nodes: dict[int, None] = {}
        # A preemption search's room per node (``preemption._RoomTally``): -1 for every
        # node between searches.
        self.room_scratch = [-1] * len(self.names)
        # The node of every change of the free or releasing GPUs, in order, so that a
        # caller can tell whether an answer it computed from them still holds and which
        # nodes to look at again.
        self.changed: list[int] = []
        # Per (topology level, rank size): what ``roomiest_domains`` counted.
        self.domain_rooms: dict[tuple[str, int], DomainRooms] = {}
        # Per rank size: the fewest ranks that did not fit on free GPUs since the free
        # GPUs last grew (a gang of as many or more ranks cannot fit either).
        self.unplaceable_on_free: dict[int, int] = {}
        # The same per (topology level, rank size), for gangs that need one domain.
        self.unplaceable_in_domain: dict[tuple[str, int], int] = {}

    def occupy(
        self, held: Sequence[int], terminating: Sequence[tuple[str, tuple[tuple[int, int], ...]]]
    ) -> None:
        """Start from the snapshot: ``held`` GPUs per node (running and terminating ranks
        alike, R1) and the terminating jobs with their (node, GPUs) pairs (R11)."""
        self.free = [r1_capacity_free_gpus(gpus, held[n]) for n, gpus in enumerate(self.gpus)]
        for node, free in enumerate(self.free):
            self.by_free_gpus[free][node] = None
        self.free_total = sum(self.free)
        for job, on_nodes in terminating:
            for node, gpus in on_nodes:
                self.releasing[node] += gpus
                self.releasing_jobs[node].append((job, gpus))
        self.releasing_nodes = {
            node: None for node, releasing in enumerate(self.releasing) if releasing > 0
        }

    def release(self, node: int, gpus: int, job: str) -> None:
        """Count ``gpus`` GPUs of ``node`` as on their way back from terminating ``job``,
        the first to be claimed there: they are released for the workload being planned."""
        self.releasing[node] += gpus
        self.releasing_jobs[node].insert(0, (job, gpus))
        self.releasing_nodes[node] = None
        self.changed.append(node)

    def take_releasing(self, node: int, gpus: int) -> list[str]:
        """Claim ``gpus`` of the GPUs on their way back to ``node``; the jobs releasing
        them, each named once."""
        self.releasing[node] -= gpus
        if self.releasing[node] == 0:
            self.releasing_nodes.pop(node, None)
        self.changed.append(node)
        owners = self.releasing_jobs[node]
        taken: list[str] = []
        while gpus > 0 and owners:
            job, left = owners[0]
            taken.append(job)
            if left <= gpus:
                gpus -= left
                owners.pop(0)
            else:
                owners[0] = (job, left - gpus)
                gpus = 0
        return taken

    def set_free(self, node: int, free: int) -> None:
        """Record that ``node`` now has ``free`` free GPUs."""
        old = self.free[node]
        del self.by_free_gpus[old][node]
        self.by_free_gpus[free][node] = None
        self.free[node] = free
        self.free_total += free - old
        self.changed.append(node)

    def may_place_free(self, ranks: int, gpus_per_rank: int) -> bool:
        """The cheap tests of ``place_free``: on a full cluster most gangs stop here."""
        known_failure = self.unplaceable_on_free.get(gpus_per_rank)
        return (
            ranks * gpus_per_rank <= self.free_total
            and gpus_per_rank <= self.max_node_gpus
            and (known_failure is None or ranks < known_failure)
        )

    def place_free(self, ranks: int, gpus_per_rank: int) -> Placement | None:
        """R10 on free GPUs only: best fit for a gang that fits one node, else largest first."""
        if not self.may_place_free(ranks, gpus_per_rank):
            return None
        by_free_gpus = self.by_free_gpus
        most = self.max_node_gpus
        # Nodes set aside while the largest are filled first: (node, ranks, free GPUs).
        taken: list[tuple[int, int, int]] = []
        remaining = ranks
        placement: Placement | None = None
        while True:
            need = remaining * gpus_per_rank
            chosen = -1
            for free in range(need, most + 1):
                if by_free_gpus[free]:
                    chosen = next(iter(by_free_gpus[free]))
                    break
            if chosen >= 0:
                placement = [*[(node, fit) for node, fit, _ in taken], (chosen, remaining)]
                break
            largest = -1
            for free in range(most, gpus_per_rank - 1, -1):
                if by_free_gpus[free]:
                    largest = free
                    break
            if largest < 0:
                break
            node = next(iter(by_free_gpus[largest]))
            del by_free_gpus[largest][node]
            fit = largest // gpus_per_rank
            taken.append((node, fit, largest))
            remaining -= fit
        for node, _, free in taken:
            by_free_gpus[free][node] = None
        if placement is None:
            self.unplaceable_on_free[gpus_per_rank] = min(
                ranks, self.unplaceable_on_free.get(gpus_per_rank, ranks)
            )
        return placement

    def hostable_ranks(self, gpus_per_rank: int) -> int:
        """R2: ranks of ``gpus_per_rank`` GPUs that free plus releasing GPUs could host.

        A gang is admitted only when this reaches its rank count: all ranks or none.
        Only whole ranks count (nine GPUs free as 3 + 3 + 3 host no rank of 4). The
        nodes are counted by how many GPUs they have free, not one by one: this runs for
        every preemption attempt.
        """
        by_free_gpus = self.by_free_gpus
        total = 0
        for free_gpus in range(gpus_per_rank, self.max_node_gpus + 1):
            if by_free_gpus[free_gpus]:
                total += len(by_free_gpus[free_gpus]) * (free_gpus // gpus_per_rank)
        free = self.free
        releasing = self.releasing
        for node in self.releasing_nodes:
            total += (free[node] + releasing[node]) // gpus_per_rank - free[node] // gpus_per_rank
        return total

    def place_on(
        self, ranks: int, gpus_per_rank: int, room_after: Mapping[int, int]
    ) -> Placement | None:
        """R10 on free and releasing GPUs, with ``room_after`` (node -> GPUs once the
        releases and the chosen victims are done) overriding a node's room."""
        whole = self._best_whole_host(ranks, gpus_per_rank, room_after)
        if whole >= 0:
            return [(whole, ranks)]
        available: dict[str, int] = {}
        names = self.names
        for node, room in room_after.items():
            if room >= gpus_per_rank:
                available[names[node]] = room
        for node in self.releasing_nodes:
            if node not in room_after:
                room = self.free[node] + self.releasing[node]
                if room >= gpus_per_rank:
                    available[names[node]] = room
        # Untouched nodes with free GPUs, largest first, until the gang surely fits.
        enough = sum(room // gpus_per_rank for room in available.values())
        for free in range(self.max_node_gpus, gpus_per_rank - 1, -1):
            if enough >= ranks and free < ranks * gpus_per_rank:
                break
            for node in self.by_free_gpus[free]:
                if names[node] not in available:
                    available[names[node]] = free
                    enough += free // gpus_per_rank
        placed = r10_place(ranks, gpus_per_rank, available)
        if placed is None:
            return None
        return [(self.index[name], on_node) for name, on_node in placed]

    def place_within(self, ranks: int, gpus_per_rank: int, on: Sequence[int]) -> Placement | None:
        """R10 on the free and releasing GPUs of the nodes ``on`` alone: where a workload
        goes that waits for the GPUs being freed for it there."""
        free = self.free
        releasing = self.releasing
        names = self.names
        available = {names[node]: free[node] + releasing[node] for node in on}
        placed = r10_place(ranks, gpus_per_rank, available)
        if placed is None:
            return None
        return [(self.index[name], on_node) for name, on_node in placed]

    def _best_whole_host(
        self, ranks: int, gpus_per_rank: int, room_after: Mapping[int, int]
    ) -> int:
        """The node ``place_on`` gives the whole gang when one of the nodes it offers
        ``r10_place`` holds it: the one with room for the fewest ranks, ties by name
        (R10's best fit); -1 when none does.

        Found here rather than by ``r10_place`` over every node on offer: most gangs
        fit one node, and on a full cluster ``place_on`` runs for every workload that
        waits on releasing GPUs; the untouched nodes are looked at by their free GPUs,
        from the fewest that hold the gang, and no further than the best fit found.
        """
        need = ranks * gpus_per_rank
        free = self.free
        releasing = self.releasing
        releasing_nodes = self.releasing_nodes
        best = -1
        best_fit = 0
        for node, room in room_after.items():
            if room >= need:
                fit = room // gpus_per_rank
                if self._fits_better(node, fit, best, best_fit):
                    best = node
                    best_fit = fit
        for node in releasing_nodes:
            if node not in room_after:
                room = free[node] + releasing[node]
                if room >= need:
                    fit = room // gpus_per_rank
                    if self._fits_better(node, fit, best, best_fit):
                        best = node
                        best_fit = fit
        for gpus in range(need, self.max_node_gpus + 1):
            fit = gpus // gpus_per_rank
            if best >= 0 and fit > best_fit:
                break
            for node in self.by_free_gpus[gpus]:
                # Offered with its room above instead (place_on's order of sources).
                offered = room_after.get(node)
                if offered is None and node in releasing_nodes:
                    offered = free[node] + releasing[node]
                if offered is not None and offered >= gpus_per_rank:
                    continue
                if self._fits_better(node, fit, best, best_fit):
                    best = node
                    best_fit = fit
        return best

    def _fits_better(self, node: int, fit: int, best: int, best_fit: int) -> bool:
        """Whether ``node``, with room for ``fit`` ranks, is a better fit than ``best``
        (-1: none yet) with room for ``best_fit``: fewer ranks' room, ties by name."""
        return (
            best < 0 or fit < best_fit or (fit == best_fit and self.names[node] < self.names[best])
        )

    def claim(self, placement: Placement, gpus_per_rank: int) -> tuple[int, list[str]]:
        """Reserve ``placement``: free GPUs first, then releasing ones (R11).

        Returns how many releasing GPUs it takes and the jobs releasing those GPUs.
        """
        from_releasing = 0
        released_by: list[str] = []
        for node, ranks in placement:
            need = ranks * gpus_per_rank
            from_free = min(self.free[node], need)
            if from_free:
                self.set_free(node, self.free[node] - from_free)
            rest = r11_releasing_first(self.releasing[node], need - from_free)
            if rest:
                from_releasing += rest
                released_by.extend(self.take_releasing(node, rest))
        return from_releasing, released_by

    def roomiest_domains(
        self, level: str, gpus_per_rank: int, extra: Sequence[int], count: int
    ) -> list[str]:
        """The ``count`` domains of ``level`` with the most room for ranks of
        ``gpus_per_rank`` GPUs, counting per node its free and releasing GPUs plus
        ``extra`` (which must not change between calls); ties go by name.

        Each domain's room is kept per (level, rank size) and counted again only for
        the domains whose nodes changed since the last call: on a full cluster many
        waiting gangs ask in a row while few nodes change.
        """
        domains = self.domains.get(level)
        if not domains:
            return []
        free = self.free
        releasing = self.releasing

        def room(members: list[int]) -> int:
            return sum((free[n] + releasing[n] + extra[n]) // gpus_per_rank for n in members)

        key = (level, gpus_per_rank)
        known = self.domain_rooms.get(key)
        if known is None:
            known = self.domain_rooms[key] = DomainRooms(
                {name: room(members) for name, members in domains.items()}, len(self.changed)
            )
        elif known.seen < len(self.changed):
            domain_of = self.domain_of[level]
            for name in {domain_of[node] for node in self.changed[known.seen :]}:
                if name is not None:
                    known.rooms[name] = room(domains[name])
            known.seen = len(self.changed)
            known.roomiest.clear()
        if len(known.roomiest) < count:
            best = heapq.nsmallest(count, known.rooms.items(), key=lambda item: (-item[1], item[0]))
            known.roomiest = [name for name, _ in best]
        return known.roomiest[:count]

    def hostable_in(self, domain: Sequence[int], gpus_per_rank: int) -> int:
        """R2 inside one topology domain: ranks its free plus releasing GPUs could host."""
        free = self.free
        releasing = self.releasing
        return sum((free[node] + releasing[node]) // gpus_per_rank for node in domain)

    def place_in(
        self,
        domain: Sequence[int],
        ranks: int,
        gpus_per_rank: int,
        room_after: Mapping[int, int] | None = None,
        *,
        releasing: bool = True,
    ) -> Placement | None:
        """R10 inside one topology domain, on free GPUs (and releasing ones unless
        ``releasing`` is False), with ``room_after`` overriding a node's room."""
        names = self.names
        available: dict[str, int] = {}
        hostable = 0
        for node in domain:
            room = self.free[node] + (self.releasing[node] if releasing else 0)
            if room_after is not None and node in room_after:
                room = room_after[node]
            if room >= gpus_per_rank:
                available[names[node]] = room
                hostable += room // gpus_per_rank
        if hostable < ranks:
            return None
        placed = r10_place(ranks, gpus_per_rank, available)
        if placed is None:
            return None
        return [(self.index[name], on_node) for name, on_node in placed]

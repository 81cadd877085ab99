"""Parse the local runtime's inventory of virtual nodes from a settings string.

A node's GPU count also names its GPUs: the runtime gives each rank indices from 0 to
that count less one (gpu_slots.py). On a real GPU host the node is this host and the
indices are its devices; nothing checks that the host has that many.
"""

from __future__ import annotations

from preemption.runtimes.base import NodeInventory


def parse_inventory(text: str) -> list[NodeInventory]:
    """Parse `name:flavor:gpus[:level=domain/level=domain...]` entries separated by
    commas into nodes.

    Example: "gpu-a:h100-80gb:8:block=b0/rack=r1,gpu-b:h100-80gb:8". The optional
    fourth field is the node's topology, one domain per level. Whitespace around entries
    and fields is ignored. Raises ValueError naming the faulty entry for an empty
    inventory, an entry without three or four fields, an empty name or flavor, a GPU
    count that is not a positive integer, a topology pair without a level or a domain
    or with a level given twice, or a node name given twice.
    """
    nodes: list[NodeInventory] = []
    seen: set[str] = set()
    entries = [entry.strip() for entry in text.split(",")]
    if not any(entries):
        raise ValueError("node inventory is empty: expected name:flavor:gpus[,name:flavor:gpus...]")
    for position, entry in enumerate(entries, start=1):
        fields = [field.strip() for field in entry.split(":")]
        if len(fields) not in (3, 4):
            raise ValueError(
                f"node inventory entry {position} ({entry!r}) must be "
                "name:flavor:gpus[:level=domain/...]"
            )
        name, flavor, gpus_text = fields[:3]
        topology = _topology(position, entry, fields[3]) if len(fields) == 4 else ()
        if not name or not flavor:
            raise ValueError(
                f"node inventory entry {position} ({entry!r}) needs a node name and a flavor"
            )
        if not (gpus_text.isascii() and gpus_text.isdigit()) or int(gpus_text) < 1:
            raise ValueError(
                f"node inventory entry {position} ({entry!r}): GPU count {gpus_text!r} "
                "is not a positive integer"
            )
        gpus = int(gpus_text)
        if name in seen:
            raise ValueError(f"node inventory names node {name!r} twice")
        seen.add(name)
        nodes.append(NodeInventory(name=name, flavor=flavor, gpus=gpus, topology=topology))
    return nodes


def _topology(position: int, entry: str, text: str) -> tuple[tuple[str, str], ...]:
    pairs: dict[str, str] = {}
    for pair in text.split("/"):
        level, _, domain = (part.strip() for part in pair.partition("="))
        if not level or not domain:
            raise ValueError(
                f"node inventory entry {position} ({entry!r}): topology {pair.strip()!r} "
                "must be level=domain"
            )
        if level in pairs:
            raise ValueError(f"node inventory entry {position} ({entry!r}) gives the {level} twice")
        pairs[level] = domain
    return tuple(pairs.items())

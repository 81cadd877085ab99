"""Parse the local runtime's inventory of virtual nodes from a settings string."""

from __future__ import annotations

from preemption.runtimes.base import NodeInventory


def parse_inventory(text: str) -> list[NodeInventory]:
    """Parse `name:flavor:gpus` entries separated by commas into nodes.

    Example: "gpu-a:h100-80gb:8,gpu-b:h100-80gb:8". Whitespace around entries and fields
    is ignored. Raises ValueError naming the faulty entry for an empty inventory, an entry
    without exactly three fields, an empty name or flavor, a GPU count that is not a
    positive integer, or a node name given twice.
    """
    nodes: list[NodeInventory] = []
    seen: set[str] = set()
    entries = [entry.strip() for entry in text.split(",")]
    if not any(entries):
        raise ValueError("node inventory is empty: expected name:flavor:gpus[,name:flavor:gpus...]")
    for position, entry in enumerate(entries, start=1):
        fields = [field.strip() for field in entry.split(":")]
        if len(fields) != 3:
            raise ValueError(
                f"node inventory entry {position} ({entry!r}) must be name:flavor:gpus"
            )
        name, flavor, gpus_text = fields
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
        nodes.append(NodeInventory(name=name, flavor=flavor, gpus=gpus))
    return nodes

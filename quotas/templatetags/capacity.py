"""The over-commitment warning every page that shows guarantees carries: where a
flavor's top-level guarantees exceed its schedulable GPUs (typically while a node
is drained), `{% capacity_warnings %}` says so, with the drained nodes.

A tag rather than a context variable so that the dashboard's flavor card, the
team pages and the Nodes page show one wording without each view reading it;
the figures are read once per rendered page."""

from __future__ import annotations

from typing import Any

from django import template

from quotas.selectors import CapacityShortfall, capacity_shortfalls

register = template.Library()


def _shortfalls(context: template.Context) -> list[CapacityShortfall]:
    cache = context.render_context
    if "capacity_shortfalls" not in cache:
        cache["capacity_shortfalls"] = capacity_shortfalls()
    return cache["capacity_shortfalls"]  # type: ignore[no-any-return]


@register.inclusion_tag("quotas/_capacity_warning.html", takes_context=True)
def capacity_warnings(
    context: template.Context,
    flavor: str | None = None,
    flavors: Any = None,
    compact: bool = False,
) -> dict[str, Any]:
    """The warnings of one flavor, of the flavors in `flavors`, or (neither) of all;
    `compact` leaves out the explanation (the dashboard's flavor card is narrow)."""
    shortfalls = _shortfalls(context)
    if flavor is not None:
        shortfalls = [item for item in shortfalls if item.flavor == flavor]
    elif flavors is not None:
        wanted = set(flavors)
        shortfalls = [item for item in shortfalls if item.flavor in wanted]
    return {"shortfalls": shortfalls, "compact": compact, "user": context.get("user")}

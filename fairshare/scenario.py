"""The JSON scenario format: snapshots and quota changes in, plans and consequences out.

Every parse error is a ``ScenarioError`` whose message starts with the path of the
offending field, for example ``workloads[3].gpus_per_rank: expected an integer``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .engine import check_snapshot
from .model import (
    CONSOLIDATION_MIN_RUNTIME_SECONDS,
    FAIR_SHARE_MIN_RUNTIME_SECONDS,
    PREEMPTION_POLICIES,
    PRIORITY_MIN_RUNTIME_SECONDS,
    RECLAIM_MIN_RUNTIME_SECONDS,
    UNSET,
    USAGE_HALF_LIFE_SECONDS,
    WORKLOAD_STATES,
    Consequences,
    FlavorQuota,
    Node,
    Plan,
    PriorityClass,
    Queue,
    QuotaChange,
    ScenarioError,
    Snapshot,
    Unset,
    Workload,
)

_MISSING = object()


def _field(record: Mapping[str, Any], key: str, where: str, default: Any = _MISSING) -> Any:
    if key in record:
        return record[key]
    if default is _MISSING:
        raise ScenarioError(f"{where}.{key}: required field is missing")
    return default


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ScenarioError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _integer(value: Any, where: str, minimum: int | None = None) -> int:
    # JSON has one number type; accept 8.0 for 8 but not 8.5 or true.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScenarioError(f"{where}: expected an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ScenarioError(f"{where}: expected an integer, got {value!r}")
    number = int(value)
    if minimum is not None and number < minimum:
        raise ScenarioError(f"{where}: must be at least {minimum}, got {number}")
    return number


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScenarioError(f"{where}: expected a number, got {value!r}")
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):
        raise ScenarioError(f"{where}: expected a finite number, got {value!r}")
    return number


def _optional_number(value: Any, where: str) -> float | None:
    return None if value is None else _number(value, where)


def _optional_integer(value: Any, where: str) -> int | None:
    return None if value is None else _integer(value, where, minimum=0)


def _boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ScenarioError(f"{where}: expected true or false, got {value!r}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ScenarioError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _records(value: Any, where: str) -> list[Mapping[str, Any]]:
    if not isinstance(value, list):
        raise ScenarioError(f"{where}: expected a list, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise ScenarioError(f"{where}[{i}]: expected an object, got {type(item).__name__}")
    return value


def _flavor_map(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ScenarioError(f"{where}: expected an object of flavor -> value")
    return value


def _queue(record: Mapping[str, Any], where: str) -> Queue:
    name = _string(_field(record, "name", where), f"{where}.name")
    parent = _field(record, "parent", where, None)
    if parent is not None:
        parent = _string(parent, f"{where}.parent")
    weight = _number(_field(record, "weight", where, 1.0), f"{where}.weight")
    if weight <= 0:
        raise ScenarioError(f"{where}.weight: must be positive, got {weight}")
    guarantees = _flavor_map(_field(record, "guarantee", where, None), f"{where}.guarantee")
    borrow = _flavor_map(_field(record, "borrow_limit", where, None), f"{where}.borrow_limit")
    lend = _flavor_map(_field(record, "lend_limit", where, None), f"{where}.lend_limit")
    quotas: dict[str, FlavorQuota] = {}
    for flavor in sorted(set(guarantees) | set(borrow) | set(lend)):
        quotas[flavor] = FlavorQuota(
            guarantee=_integer(guarantees.get(flavor, 0), f"{where}.guarantee.{flavor}", 0),
            borrow_limit=_optional_integer(borrow.get(flavor), f"{where}.borrow_limit.{flavor}"),
            lend_limit=_optional_integer(lend.get(flavor), f"{where}.lend_limit.{flavor}"),
        )
    recent = {
        str(flavor): _number(value, f"{where}.recent_usage.{flavor}")
        for flavor, value in _flavor_map(
            _field(record, "recent_usage", where, None), f"{where}.recent_usage"
        ).items()
    }
    return Queue(name=name, parent=parent, weight=weight, quotas=quotas, recent_usage=recent)


def _priority_class(record: Mapping[str, Any], where: str) -> PriorityClass:
    policy = _field(record, "preemption_policy", where)
    if policy not in PREEMPTION_POLICIES:
        raise ScenarioError(
            f"{where}.preemption_policy: must be one of {list(PREEMPTION_POLICIES)}, got {policy!r}"
        )
    grace = _number(_field(record, "grace_seconds", where), f"{where}.grace_seconds")
    minimum = _number(
        _field(record, "min_runtime_seconds", where, 0.0), f"{where}.min_runtime_seconds"
    )
    if grace < 0 or minimum < 0:
        raise ScenarioError(f"{where}: grace_seconds and min_runtime_seconds must not be negative")
    by_reason_record = _field(record, "min_runtime_by_reason", where, {})
    if not isinstance(by_reason_record, Mapping):
        raise ScenarioError(
            f"{where}.min_runtime_by_reason: expected an object, got {by_reason_record!r}"
        )
    by_reason = {
        str(reason): _number(value, f"{where}.min_runtime_by_reason.{reason}")
        for reason, value in by_reason_record.items()
    }
    return PriorityClass(
        name=_string(_field(record, "name", where), f"{where}.name"),
        value=_integer(_field(record, "value", where), f"{where}.value"),
        preemption_policy=policy,
        preemptible=_boolean(_field(record, "preemptible", where), f"{where}.preemptible"),
        grace_seconds=grace,
        min_runtime_seconds=minimum,
        min_runtime_by_reason=by_reason,
        shrink_elastic=_boolean(
            _field(record, "shrink_elastic", where, False), f"{where}.shrink_elastic"
        ),
    )


def _workload(record: Mapping[str, Any], where: str) -> Workload:
    workload_id = _field(record, "id", where)
    if isinstance(workload_id, bool) or not isinstance(workload_id, str | int):
        raise ScenarioError(f"{where}.id: expected a string, got {workload_id!r}")
    state = _field(record, "state", where)
    if state not in WORKLOAD_STATES:
        raise ScenarioError(f"{where}.state: must be one of {list(WORKLOAD_STATES)}, got {state!r}")
    placement: list[tuple[str, int]] = []
    for i, entry in enumerate(
        _records(_field(record, "placement", where, []), f"{where}.placement")
    ):
        at = f"{where}.placement[{i}]"
        placement.append(
            (
                _string(_field(entry, "node", at), f"{at}.node"),
                _integer(_field(entry, "ranks", at), f"{at}.ranks", 1),
            )
        )
    if state != "pending" and not placement:
        raise ScenarioError(f"{where}.placement: a {state} workload needs a placement")
    topology = _field(record, "topology", where, None)
    level: str | None = None
    required = True
    if topology is not None:
        if not isinstance(topology, Mapping):
            raise ScenarioError(f"{where}.topology: expected an object, got {topology!r}")
        level = _string(_field(topology, "level", f"{where}.topology"), f"{where}.topology.level")
        required = _boolean(
            _field(topology, "required", f"{where}.topology", True), f"{where}.topology.required"
        )
    preemptor = _field(record, "preemptor", where, None)
    if preemptor is not None:
        preemptor = _string(preemptor, f"{where}.preemptor")
        if state != "terminating":
            raise ScenarioError(
                f"{where}.preemptor: only a terminating workload is being freed for another"
                f" (this one is {state})"
            )
    sizes = tuple(
        _integer(size, f"{where}.sizes[{i}]", 1)
        for i, size in enumerate(_list(_field(record, "sizes", where, []), f"{where}.sizes"))
    )
    return Workload(
        id=str(workload_id),
        queue=_string(_field(record, "queue", where), f"{where}.queue"),
        priority_class=_string(_field(record, "priority_class", where), f"{where}.priority_class"),
        flavor=_string(_field(record, "flavor", where), f"{where}.flavor"),
        ranks=_integer(_field(record, "ranks", where), f"{where}.ranks", 1),
        gpus_per_rank=_integer(_field(record, "gpus_per_rank", where), f"{where}.gpus_per_rank", 1),
        state=state,
        submitted_at=_number(_field(record, "submitted_at", where), f"{where}.submitted_at"),
        admitted_at=_optional_number(
            _field(record, "admitted_at", where, None), f"{where}.admitted_at"
        ),
        placement=tuple(placement) if state != "pending" else (),
        last_checkpoint_at=_optional_number(
            _field(record, "last_checkpoint_at", where, None), f"{where}.last_checkpoint_at"
        ),
        topology_level=level,
        topology_required=required,
        preemptor=preemptor,
        sizes=sizes,
    )


def snapshot_from_dict(document: Mapping[str, Any]) -> Snapshot:
    """Parse a scenario (the JSON format of issue 3) into a validated ``Snapshot``.

    Optional fields take their defaults (weight 1, no limits, no checkpoint, no minimum
    runtime, the plan's thresholds of ``Snapshot``); unknown fields are ignored. Raises ``ScenarioError`` naming the field.
    """
    if not isinstance(document, Mapping):
        raise ScenarioError("scenario: expected a JSON object")
    now = _number(_field(document, "now", "scenario"), "now")
    nodes = tuple(
        Node(
            name=_string(_field(r, "name", f"nodes[{i}]"), f"nodes[{i}].name"),
            flavor=_string(_field(r, "flavor", f"nodes[{i}]"), f"nodes[{i}].flavor"),
            gpus=_integer(_field(r, "gpus", f"nodes[{i}]"), f"nodes[{i}].gpus", 0),
            topology={
                str(level): _string(domain, f"nodes[{i}].topology.{level}")
                for level, domain in _flavor_map(
                    _field(r, "topology", f"nodes[{i}]", None), f"nodes[{i}].topology"
                ).items()
            },
        )
        for i, r in enumerate(_records(_field(document, "nodes", "scenario"), "nodes"))
    )
    queues = tuple(
        _queue(r, f"queues[{i}]")
        for i, r in enumerate(_records(_field(document, "queues", "scenario"), "queues"))
    )
    classes = tuple(
        _priority_class(r, f"priority_classes[{i}]")
        for i, r in enumerate(
            _records(_field(document, "priority_classes", "scenario"), "priority_classes")
        )
    )
    workloads = tuple(
        _workload(r, f"workloads[{i}]")
        for i, r in enumerate(_records(_field(document, "workloads", "scenario", []), "workloads"))
    )
    thresholds = {
        name: _number(_field(document, name, "scenario", default), name)
        for name, default in (
            ("fair_share_min_runtime_seconds", FAIR_SHARE_MIN_RUNTIME_SECONDS),
            ("consolidation_min_runtime_seconds", CONSOLIDATION_MIN_RUNTIME_SECONDS),
            ("priority_min_runtime_seconds", PRIORITY_MIN_RUNTIME_SECONDS),
            ("reclaim_min_runtime_seconds", RECLAIM_MIN_RUNTIME_SECONDS),
            ("usage_strength", 0.0),
            ("usage_half_life_seconds", USAGE_HALF_LIFE_SECONDS),
        )
    }
    snapshot = Snapshot(
        now=now,
        nodes=nodes,
        queues=queues,
        priority_classes=classes,
        workloads=workloads,
        fair_share_min_runtime_seconds=thresholds["fair_share_min_runtime_seconds"],
        consolidation_min_runtime_seconds=thresholds["consolidation_min_runtime_seconds"],
        priority_min_runtime_seconds=thresholds["priority_min_runtime_seconds"],
        reclaim_min_runtime_seconds=thresholds["reclaim_min_runtime_seconds"],
        usage_strength=thresholds["usage_strength"],
        usage_half_life_seconds=thresholds["usage_half_life_seconds"],
    )
    validate(snapshot)
    return snapshot


def validate(snapshot: Snapshot) -> None:
    """Check the references inside a snapshot; raises ``ScenarioError`` naming the field."""
    check_snapshot(snapshot)


def snapshot_to_dict(snapshot: Snapshot) -> dict[str, Any]:
    """The scenario form of a snapshot, the inverse of ``snapshot_from_dict``."""
    return {
        "now": snapshot.now,
        "fair_share_min_runtime_seconds": snapshot.fair_share_min_runtime_seconds,
        "consolidation_min_runtime_seconds": snapshot.consolidation_min_runtime_seconds,
        "priority_min_runtime_seconds": snapshot.priority_min_runtime_seconds,
        "reclaim_min_runtime_seconds": snapshot.reclaim_min_runtime_seconds,
        "usage_strength": snapshot.usage_strength,
        "usage_half_life_seconds": snapshot.usage_half_life_seconds,
        "nodes": [
            {"name": n.name, "flavor": n.flavor, "gpus": n.gpus, "topology": dict(n.topology)}
            for n in snapshot.nodes
        ],
        "queues": [
            {
                "name": q.name,
                "parent": q.parent,
                "weight": q.weight,
                "guarantee": {f: quota.guarantee for f, quota in q.quotas.items()},
                "borrow_limit": {f: quota.borrow_limit for f, quota in q.quotas.items()},
                "lend_limit": {f: quota.lend_limit for f, quota in q.quotas.items()},
                "recent_usage": dict(q.recent_usage),
            }
            for q in snapshot.queues
        ],
        "priority_classes": [
            {
                "name": c.name,
                "value": c.value,
                "preemption_policy": c.preemption_policy,
                "preemptible": c.preemptible,
                "grace_seconds": c.grace_seconds,
                "min_runtime_seconds": c.min_runtime_seconds,
                "min_runtime_by_reason": dict(c.min_runtime_by_reason),
                **({"shrink_elastic": True} if c.shrink_elastic else {}),
            }
            for c in snapshot.priority_classes
        ],
        "workloads": [
            {
                "id": w.id,
                "queue": w.queue,
                "priority_class": w.priority_class,
                "flavor": w.flavor,
                "ranks": w.ranks,
                "gpus_per_rank": w.gpus_per_rank,
                "state": w.state,
                "submitted_at": w.submitted_at,
                "admitted_at": w.admitted_at,
                "placement": [{"node": n, "ranks": r} for n, r in w.placement],
                "last_checkpoint_at": w.last_checkpoint_at,
                **(
                    {"topology": {"level": w.topology_level, "required": w.topology_required}}
                    if w.topology_level is not None
                    else {}
                ),
                **({"preemptor": w.preemptor} if w.preemptor is not None else {}),
                **({"sizes": list(w.sizes)} if w.sizes else {}),
            }
            for w in snapshot.workloads
        ],
    }


def plan_to_dict(p: Plan) -> dict[str, Any]:
    """The JSON output of ``python -m fairshare plan``; ``resize`` only when the plan
    resizes running elastic work, so that other plans read as they always did."""
    output: dict[str, Any] = {
        "admit": [
            {
                "id": a.id,
                "placement": [{"node": n, "ranks": r} for n, r in a.placement],
                "borrowed": a.borrowed,
            }
            for a in p.admit
        ],
        "preempt": [
            {
                "id": e.id,
                "reason": e.reason,
                "preemptor": e.preemptor,
                "grace_seconds": e.grace_seconds,
            }
            for e in p.preempt
        ],
        "waiting": [{"id": w.id, "reason": w.reason} for w in p.waiting],
        "queues": {
            name: {
                flavor: {
                    "guarantee": s.guarantee,
                    "usage": s.usage,
                    "fair_share": s.fair_share,
                    "borrowed": s.borrowed,
                    "lent": s.lent,
                }
                for flavor, s in flavors.items()
            }
            for name, flavors in p.queues.items()
        },
    }
    if p.resize:
        output["resize"] = [
            {
                "workload": r.workload,
                "ranks": r.ranks,
                "placement": [{"node": n, "ranks": ranks} for n, ranks in r.placement],
                "reason": r.reason,
                "for_workload": r.for_workload,
            }
            for r in p.resize
        ]
    return output


def consequences_to_dict(c: Consequences) -> dict[str, Any]:
    """The JSON output of ``python -m fairshare diff``."""
    return c.to_dict()


def _change_value(record: Mapping[str, Any], key: str, where: str) -> int | Unset | None:
    if key not in record:
        return UNSET
    return _optional_integer(record[key], f"{where}.{key}")


def changes_from_list(document: Any) -> list[QuotaChange]:
    """Parse ``[{"queue", "flavor", "guarantee"?, "borrow_limit"?, "lend_limit"?, "weight"?}]``."""
    changes: list[QuotaChange] = []
    for i, record in enumerate(_records(document, "changes")):
        where = f"changes[{i}]"
        weight: float | Unset = UNSET
        if "weight" in record:
            weight = _number(record["weight"], f"{where}.weight")
            if weight <= 0:
                raise ScenarioError(f"{where}.weight: must be positive, got {weight}")
        changes.append(
            QuotaChange(
                queue=_string(_field(record, "queue", where), f"{where}.queue"),
                flavor=_string(_field(record, "flavor", where), f"{where}.flavor"),
                guarantee=_change_value(record, "guarantee", where),
                borrow_limit=_change_value(record, "borrow_limit", where),
                lend_limit=_change_value(record, "lend_limit", where),
                weight=weight,
            )
        )
    return changes


def changes_to_list(changes: Sequence[QuotaChange]) -> list[dict[str, Any]]:
    """The JSON form of quota changes, leaving out fields that stay as they are."""
    out: list[dict[str, Any]] = []
    for change in changes:
        record: dict[str, Any] = {"queue": change.queue, "flavor": change.flavor}
        for key in ("guarantee", "borrow_limit", "lend_limit", "weight"):
            value = getattr(change, key)
            if not isinstance(value, Unset):
                record[key] = value
        out.append(record)
    return out

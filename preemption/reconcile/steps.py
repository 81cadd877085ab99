"""What the stages of a reconcile pass hand one another: the `Step` the decide
step finds an attempt needs, the gang spec a launch carries, the lease of a
claimed action, and `guarded`, which keeps one attempt's trouble its own.

The stages import this module; it imports none of them. It decides nothing
and calls no runtime.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import connection, transaction
from django.db.models import BigIntegerField, ForeignObjectRel, Model, QuerySet
from django.db.models.base import ModelState
from django.db.models.expressions import RawSQL

from preemption.event_tokens import attempt_events_token
from preemption.models import Attempt, Job, PreemptionEvent, Rank
from preemption.runtimes.base import (
    GangId,
    GangSpec,
    RankPlacement,
    RuntimePermanentError,
    RuntimeTemporaryError,
)

logger = logging.getLogger(__name__)

TERMINAL_PHASES = ("exited", "lost")


T = TypeVar("T")
M = TypeVar("M", bound=Model)
FINISH = "finish"
# A claim older than this belonged to a worker that died while acting: longer than
# any single runtime call may take (the local launcher's timeout, the Celery task's
# hard time limit).
ACTION_LEASE = timedelta(seconds=180)


def among(ids: Iterable[int]) -> RawSQL:
    """The ids as one parameter, to filter by (`pk__in=among(ids)`): on PostgreSQL one
    array, unnested, on SQLite one JSON array.

    A pass over a few thousand gangs filters a dozen queries by as many ids. As an
    `__in` list, Django wrote a placeholder and prepared a value for each id, the
    driver interpolated each into the statement's text and the server parsed it
    again: about 10 ms a query at 2,400 ids, against 1 ms as one parameter."""
    numbers = [int(number) for number in ids]
    if connection.vendor == "postgresql":
        return RawSQL(
            "SELECT unnest(%s::bigint[])",
            ["{" + ",".join(map(str, numbers)) + "}"],
            output_field=BigIntegerField(),
        )
    return RawSQL(
        "SELECT value FROM json_each(%s)", [json.dumps(numbers)], output_field=BigIntegerField()
    )


def loaded(rows: QuerySet[M], *related: str) -> list[M]:
    """The rows of `rows` as its model's objects, every column loaded, built from
    plain rows (`values_list`) rather than through the model's `__init__`; with each
    of `related` loaded along, as `select_related` would: a forward foreign key
    ("job", "job__team") read in the same query, or the one object of a reverse
    one-to-one ("preemption", or None) in one more. Objects a foreign key reaches
    are built once per row they stand for and shared (a team's thousand jobs hold
    one team object), as they are only read.

    A pass that decides for a few thousand gangs at once (the first after a restart,
    or the one after a cycle that preempted two thousand jobs) reads their attempts,
    jobs, ranks and stops whole, and building each through `__init__`, which sets
    every field through its descriptor and looks up its default, took most of the
    time the pass spent reading them: several times what this takes. The objects are
    what Django's own loading makes: each column's value as the database converters
    gave it, and the state of an object read from the database, so that
    `save(update_fields=...)` and related lookups work as on any other. The models
    read this way have no `pre_init` or `post_init` receivers (a test holds them to
    it)."""
    model = rows.model
    database = rows.db
    forward = [path for path in related if _forward(model, path)]
    reverse = [path for path in related if path not in forward]
    # Per model read: its columns' names, where its values start in a row, the object
    # it hangs from (by its place in this list) and the field it hangs by.
    parts: list[tuple[type[Model], list[str], int, int, Any]] = []
    flat: list[str] = []
    for path in ("", *forward):
        target = _model_at(model, path)
        names = [field.attname for field in target._meta.concrete_fields]
        parent, _, name = path.rpartition("__")
        owner = ("", *forward).index(parent) if path else -1
        via = _model_at(model, parent)._meta.get_field(name) if path else None
        parts.append((target, names, len(flat), owner, via))
        flat += [f"{path}__{column}" if path else column for column in names]
    shared: list[dict[Any, Model]] = [{} for _ in parts]
    built: list[M] = []
    for values in rows.values_list(*flat):
        objs: list[Model | None] = []
        for (target, names, start, owner, via), seen in zip(parts, shared, strict=True):
            if via is None:
                objs.append(_built(target, names, values[start : start + len(names)], database))
                continue
            key = values[start]
            obj = seen.get(key)
            if obj is None and key is not None:
                obj = seen[key] = _built(
                    target, names, values[start : start + len(names)], database
                )
            objs.append(obj)
            if objs[owner] is not None:
                via.set_cached_value(objs[owner], obj)
        built.append(objs[0])  # type: ignore[arg-type]
    for path in reverse:
        relation = model._meta.get_field(path)
        remote = relation.related_model
        assert isinstance(relation, ForeignObjectRel) and remote is not None
        found = {
            getattr(obj, relation.field.attname): obj
            for obj in loaded(
                remote._default_manager.using(database).filter(
                    **{f"{relation.field.attname}__in": among(obj.pk for obj in built)}
                )
            )
        }
        for obj in built:
            relation.set_cached_value(obj, found.get(obj.pk))
    return built


def _forward(model: type[Model], path: str) -> bool:
    """Whether `path` follows forward foreign keys only."""
    for name in path.split("__"):
        field = model._meta.get_field(name)
        if not field.many_to_one or field.related_model is None:
            return False
        model = field.related_model  # type: ignore[assignment]
    return True


def _model_at(model: type[Model], path: str) -> type[Model]:
    for name in path.split("__") if path else ():
        model = model._meta.get_field(name).related_model  # type: ignore[assignment]
    return model


def _built(model: type[M], names: list[str], values: tuple[Any, ...], database: str) -> M:
    obj = model.__new__(model)
    obj.__dict__.update(zip(names, values, strict=True))
    state = obj._state = ModelState()
    state.adding = False
    state.db = database
    return obj


def events_url(job_id: int) -> str:
    return f"{settings.QM_PUBLIC_URL.rstrip('/')}/api/v1/jobs/{job_id}/events/"


def gang_spec(job: Job, attempt: Attempt, ranks: Iterable[Rank]) -> GangSpec:
    per_node: dict[str, int] = defaultdict(int)
    placements = []
    for rank in sorted(ranks, key=lambda r: r.index):
        placements.append(
            RankPlacement(rank=rank.index, node=rank.node, local_rank=per_node[rank.node])
        )
        per_node[rank.node] += 1
    env = {
        **{str(k): str(v) for k, v in (job.env or {}).items()},
        "QM_JOB_ID": str(job.pk),
        "QM_ATTEMPT": str(attempt.number),
        "QM_GRACE_SECONDS": str(job.priority_class.grace_seconds),
        "QM_CHECKPOINT_DIR": job.checkpoint_dir,
        "QM_EVENTS_URL": events_url(job.pk),
        # The attempt's own token: it expires when the attempt ends.
        "QM_EVENTS_TOKEN": attempt_events_token(attempt),
    }
    return GangSpec(
        job_id=job.pk,
        attempt=attempt.number,
        command=job.command,
        ranks=tuple(placements),
        gpus_per_rank=job.gpus_per_rank,
        grace_seconds=float(job.priority_class.grace_seconds),
        priority_class=job.priority_class.name,
        env=env,
        image=job.image or None,
        team=job.team.slug,
        flavor=job.flavor.name,
        mtbp_seconds=attempt.preemption_mtbp_seconds,
    )


@dataclass
class Step:
    """What the decide step found an attempt needs from the runtime next.

    `action` is one of Attempt.Action's values, or FINISH: every rank has exited and
    the attempt is to be closed (which reads the ranks' logs first)."""

    action: str
    attempt: Attempt
    event: PreemptionEvent | None = None
    spec: GangSpec | None = None
    alive: list[int] = field(default_factory=list)
    # When the runtime call began: a signal is recorded as sent at this moment,
    # since ranks receive it while the call runs and the record must not say it
    # was sent after they received it.
    called_at: datetime | None = None
    # When it returned: a launch is recorded as done at this moment, its own, not
    # when the last of the pass's launches returned (the work a victim loses counts
    # from its launch).
    returned_at: datetime | None = None
    # A kill whose gang's evictions a disruption budget still refused: the
    # preemption's outcome says it was forced past the budget.
    forced: bool = False
    # A checkpoint notice: the signal to send ("" where the runtime answers polls).
    notice_signal: str = ""

    @property
    def gang(self) -> GangId:
        return GangId(self.attempt.job_id, self.attempt.number)


def guarded(attempt: Attempt, work: Callable[[], T], *, savepoint: bool = False) -> T | None:
    """One attempt's trouble is logged and never stops the pass for the others;
    with `savepoint`, its writes so far are undone and the others' kept.

    Two kinds of trouble are not one attempt's and end the pass: the task's time
    limit, and an error that left the enclosing transaction unusable (every later
    query in it would fail); the next pass starts afresh."""
    try:
        if savepoint:
            with transaction.atomic():
                return work()
        return work()
    except SoftTimeLimitExceeded:
        raise
    except (RuntimeTemporaryError, RuntimePermanentError):
        logger.warning("runtime error on %s; retrying next cycle", attempt, exc_info=True)
    except Exception:
        if transaction.get_connection().needs_rollback:
            raise
        logger.exception("reconciling %s failed; retrying next cycle", attempt)
    return None

"""How `qm` words what the API answers: times, sizes, and why an attempt was
preempted or resized. Pure functions of the API's JSON, so `qm show` and its tests
read the same words."""

from __future__ import annotations

from typing import Any


def short_time(value: str | None) -> str:
    if not value:
        return "-"
    return value.replace("T", " ")[:19]


def counted(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def gpus_words(job: dict[str, Any]) -> str:
    """ "2 ranks × 4 GPUs = 8 GPUs (h100-80gb)"; "1 rank × 1 GPU (h100-80gb)"; for an
    elastic job the size of its latest attempt (before the first, its largest) and its
    range: "4 ranks (elastic 2–8) × 1 GPU = 4 GPUs (h100-80gb)"."""
    attempts = job.get("attempts") or []
    ranks = attempts[-1].get("world_size") or job["ranks"] if attempts else job["ranks"]
    shape = counted(ranks, "rank")
    if job.get("ranks_min") is not None:
        sizes = job.get("rank_sizes") or []
        span = ", ".join(map(str, sizes)) if sizes else f"{job['ranks_min']}–{job['ranks']}"
        shape += f" (elastic {span})"
    shape += f" × {counted(job['gpus_per_rank'], 'GPU')}"
    if ranks != 1:
        shape += f" = {counted(ranks * job['gpus_per_rank'], 'GPU')}"
    return f"{shape} ({job['flavor']})"


def preemption_line(event: dict[str, Any]) -> str:
    """Why an attempt was stopped, in the API's own words, and how the stop went."""
    details = [f"decided {short_time(event['decided_at'])}"]
    details.append(f"grace {event['grace_seconds']:g} s")
    if event["checkpoint_step"] is not None:
        details.append(f"checkpoint at step {event['checkpoint_step']}")
    if event["outcome"]:
        details.append(f"outcome {event['outcome']}")
    return f"{event['why']} ({', '.join(details)})"


def resize_line(resize: dict[str, Any]) -> str:
    """Why an attempt was stopped to resize the job, and how the resize went."""
    details = [f"decided {short_time(resize['decided_at'])}"]
    if resize["checkpoint_step"] is not None:
        details.append(f"checkpoint at step {resize['checkpoint_step']}")
    if resize["outcome"]:
        details.append(f"outcome {resize['outcome']}")
    if resize["relaunched_as"] is not None:
        details.append(
            f"relaunched as attempt {resize['relaunched_as']} at "
            f"{counted(resize['to_ranks'], 'rank')}"
        )
    return f"{resize['why']} ({', '.join(details)})"


def failing_rank(attempt: dict[str, Any]) -> dict[str, Any] | None:
    """The rank that failed the attempt: the first to exit non-zero, else a lost one."""
    ranks: list[dict[str, Any]] = attempt["ranks"]
    failed = [r for r in ranks if r["exit_code"] not in (None, 0)]
    if failed:
        return min(failed, key=lambda r: (r["exited_at"] or "", r["index"]))
    lost = [r for r in ranks if r["state"] == "lost"]
    return lost[0] if lost else None

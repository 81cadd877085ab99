"""The runtime protocol: how the control plane launches, signals, kills and observes gangs.

A gang is every rank of one attempt of one job. Runtimes are level-triggered: every call
is idempotent, and the state a runtime needs to survive its own restart lives on disk or
in the cluster, never only in a Python object. This module imports nothing from Django.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

# The trap's variable naming the file that holds the cadence hint (gracetrap's
# protocol): every runtime sets it in the ranks' environment and keeps the file current.
MTBP_FILE_ENV = "QM_PREEMPTION_MTBP_FILE"


def mtbp_text(mtbp_seconds: float) -> str:
    """The cadence hint as the trap reads it: seconds, one line."""
    return f"{mtbp_seconds:.1f}\n"


@dataclass(frozen=True, slots=True)
class GangId:
    """Identifies a gang: one attempt of one job."""

    job_id: int
    attempt: int


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where the engine placed one rank: its node and its index among that node's ranks."""

    rank: int
    node: str
    local_rank: int


@dataclass(frozen=True, slots=True)
class GangSpec:
    """Everything a runtime needs to launch one gang.

    `command` is run by `/bin/sh -c` on every rank. `env` carries the trap's variables
    (QM_JOB_ID, QM_ATTEMPT, QM_GRACE_SECONDS, QM_CHECKPOINT_DIR, QM_EVENTS_URL,
    QM_EVENTS_TOKEN) and the user's environment; the runtime adds the rendezvous variables.
    """

    job_id: int
    attempt: int
    command: str
    ranks: tuple[RankPlacement, ...]
    gpus_per_rank: int
    grace_seconds: float
    priority_class: str
    env: Mapping[str, str]
    image: str | None = None
    team: str = ""
    flavor: str = ""
    # The control plane's estimate of the gang's mean time between preemptions, handed
    # to the ranks as the trap's cadence hint (None: none yet).
    mtbp_seconds: float | None = None

    @property
    def gang(self) -> GangId:
        """The id of the gang this spec launches."""
        return GangId(job_id=self.job_id, attempt=self.attempt)

    @property
    def world_size(self) -> int:
        """The number of ranks in the gang."""
        return len(self.ranks)


@dataclass(frozen=True, slots=True)
class RankObservation:
    """What a runtime actually sees of one rank right now.

    `phase` is one of "starting", "running", "terminating", "exited" or "lost" (the rank
    is gone and nothing recorded how it ended). `handle` is the pid (local) or the pod
    name (kubernetes). Times are Unix times from time.time(). `waiting_reason` says why
    a starting rank is not running yet when the runtime knows (Kubernetes:
    "ImagePullBackOff", "Unschedulable", ...).
    """

    job_id: int
    attempt: int
    rank: int
    node: str
    phase: str
    exit_code: int | None
    handle: str
    started_at: float | None
    exited_at: float | None
    signal_sent_at: float | None
    waiting_reason: str = ""
    # Why an exited rank ended, where the runtime knows: "out-of-memory" when the
    # kernel's OOM killer ended it inside its memory limit (`memory_limit`, bytes);
    # "disk-limit" when a kubelet evicted it past its ephemeral-storage limit.
    end_reason: str = ""
    memory_limit: int | None = None


# Reasons a starting rank may wait for ever (Kubernetes' names): past the start
# timeout the attempt fails with them instead of holding its GPUs. The kubelet
# retries each of them without end: ErrImageNeverPull is an image absent from a
# node whose pull policy is Never (set by the runtime or by an admission webhook
# in an air-gapped cluster), and a missing Secret or ConfigMap keeps
# CreateContainerConfigError until someone creates it.
STUCK_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
        "RegistryUnavailable",
        "SignatureValidationFailed",
        "CreateContainerConfigError",
        "CreateContainerError",
        "Unschedulable",
    }
)


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """A node the runtime can place ranks on, with its GPU flavor and GPU count, and
    its domain at each topology level it has, as (level, domain) pairs."""

    name: str
    flavor: str
    gpus: int
    topology: tuple[tuple[str, str], ...] = ()


class RuntimeTemporaryError(Exception):
    """A runtime call failed for a reason that may pass: retry it with backoff."""


class RuntimePermanentError(Exception):
    """A runtime call can never succeed as asked: record the failure and stop."""


class GangGuard(Protocol):
    """An optional capability: a runtime that can tell that the cluster took a rank away
    (kube-scheduler preemption, node loss) even when the rank exited 0."""

    def guard_victims(self, observations: Iterable[RankObservation] | None = None) -> list[GangId]:
        """The gangs that lost a rank to something other than the rank itself: among
        ``observations`` the caller has just made with observe(), else among every
        gang, observed afresh."""
        ...

    def taken_ranks(self, gang: GangId) -> dict[int, str]:
        """The gang's ranks that something other than the control plane and the rank
        itself ended (a drain, a kubelet's eviction), with why, as last observed."""
        ...


class ExitWatcher(Protocol):
    """An optional capability: a runtime that can say, as it happens, that ranks exited,
    so the control plane looks at their jobs at once rather than at its next periodic
    pass (the local runtime hears its keepers; the mimic runtime knows each gang's end)."""

    def watch_exits(self, stop: threading.Event, on_exit: Callable[[list[int]], None]) -> None:
        """Until `stop` is set, call `on_exit` soon after ranks exit with the ids of their
        jobs, or with an empty list when the runtime cannot tell whose they were."""
        ...


class CallsSideBySide(Protocol):
    """An optional setting: how many of the runtime's calls one reconcile pass makes side
    by side. Without it a pass makes up to eight at once, which suits calls that wait (a
    launcher process starting, the API server answering); a runtime whose calls never
    wait says 1 (the mimic runtime), and they are made one after another."""

    calls_side_by_side: int


class Runtime(Protocol):
    """The operations every runtime offers. Every call is idempotent.

    A call fails only with RuntimeTemporaryError or RuntimePermanentError: each runtime
    translates the exceptions of the libraries it uses (OSError, the Kubernetes client's
    ApiException, urllib3's errors) into these two.
    """

    name: str

    @property
    def gang_guard(self) -> GangGuard | None:
        """The runtime's gang guard, or None where a rank only ends by itself or by the
        control plane's own signal, so a failed rank is all the guard needs to see."""
        ...

    def launch(self, spec: GangSpec) -> None:
        """Start every rank of the gang; a second launch of the same gang does nothing."""
        ...

    def signal(self, gang: GangId, grace_seconds: float) -> None:
        """Ask every rank of the gang at once to stop within `grace_seconds`."""
        ...

    def kill(self, gang: GangId) -> None:
        """Stop every rank of the gang now (SIGKILL, or delete with grace 0)."""
        ...

    def observe(self, gang: GangId | None = None) -> list[RankObservation]:
        """Observe the ranks of one gang, or of every gang known when `gang` is None."""
        ...

    def nodes(self) -> list[NodeInventory]:
        """The nodes this runtime can place ranks on."""
        ...

    def read_log(self, gang: GangId, rank: int, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """Up to `limit` bytes of one rank's log, starting at byte `offset`."""
        ...

    def released_ports(self, gangs: Sequence[GangId]) -> dict[GangId, list[int]]:
        """Ports each gang still holds; an empty list means the gang left none behind.

        One call answers for every gang that ended in a pass, so a runtime can look
        once for all of them (the local runtime scans the process table once)."""
        ...

    def forget(self, gang: GangId) -> None:
        """Drop the bookkeeping of a finished gang; its logs stay readable."""
        ...

    def publish_preemption_risk(self, gang: GangId, mtbp_seconds: float, *, team: str) -> None:
        """Hand the running gang's ranks a new cadence hint (the file named by
        QM_PREEMPTION_MTBP_FILE); a hint equal to the one they have costs nothing."""
        ...


PROTOCOL_CALLS = (
    "launch",
    "signal",
    "kill",
    "observe",
    "nodes",
    "read_log",
    "released_ports",
    "forget",
    "guard_victims",
    "publish_preemption_risk",
    "notice",
)
RuntimeClass = TypeVar("RuntimeClass", bound=type)
Classify = Callable[[Exception], type[RuntimeTemporaryError] | type[RuntimePermanentError] | None]


def translate_errors(classify: Classify) -> Callable[[RuntimeClass], RuntimeClass]:
    """A class decorator: the runtime's protocol calls raise the protocol's errors only.

    `classify` names the protocol error for an exception of the libraries the runtime
    uses; an exception it returns None for is a bug in the runtime and goes through
    unchanged. The original exception stays attached as the new one's cause.
    """

    def wrap(call: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(call)
        def translated(*args: Any, **kwargs: Any) -> Any:
            try:
                return call(*args, **kwargs)
            except (RuntimeTemporaryError, RuntimePermanentError):
                raise
            except Exception as error:
                kind = classify(error)
                if kind is None:
                    raise
                raise kind(f"{name}: {type(error).__name__}: {error}") from error

        return translated

    def decorate(cls: RuntimeClass) -> RuntimeClass:
        for name in PROTOCOL_CALLS:
            call = cls.__dict__.get(name)
            if callable(call):
                setattr(cls, name, wrap(call, name))
        return cls

    return decorate


def os_errors_are_temporary(error: Exception) -> type[RuntimeTemporaryError] | None:
    """For runtimes whose only library is the operating system: a failed system call
    (a full disk, no file descriptors left, a process table full) may pass."""
    return RuntimeTemporaryError if isinstance(error, OSError) else None


def iter_log_chunks(
    runtime: Runtime, gang: GangId, rank: int, chunk: int = 1 << 20
) -> Iterator[bytes]:
    """One rank's log from its start, ``chunk`` bytes at a time, to be used as it is
    read: a log may be far larger than the memory of whoever reads it."""
    offset = 0
    while part := runtime.read_log(gang, rank, offset, chunk):
        yield part
        offset += len(part)

"""The fair-share engine: a snapshot of a GPU cluster in, a plan out.

Pure functions over frozen dataclasses; no Django, no I/O, no clock. See README.md in
this folder for the JSON scenario format and the command line. Where the engine was
compiled (``make engine``, see ``native.py``) its modules load from that build.
"""

from . import native as _native

# Before any module of the engine is imported: the build of the current sources, if
# there is one, goes first on the package's search path.
__path__ = _native.search_path(__path__)

from .collector import collector_paused
from .engine import check_snapshot, plan
from .model import (
    CONSOLIDATE,
    FAIR_SHARE,
    PREEMPTION_REASONS,
    PRIORITY,
    RECLAIM,
    UNSET,
    Admission,
    Consequences,
    FairShareMove,
    FlavorQuota,
    FrozenMap,
    Node,
    Plan,
    Preemption,
    PriorityClass,
    Queue,
    QueueStatus,
    QuotaChange,
    Resize,
    ScenarioError,
    Snapshot,
    Unset,
    Waiting,
    Workload,
    minimum_runtimes,
)
from .scenario import (
    changes_from_list,
    changes_to_list,
    consequences_to_dict,
    plan_to_dict,
    snapshot_from_dict,
    snapshot_to_dict,
)
from .shares import usage_words
from .whatif import apply_changes, diff

__all__ = [
    "CONSOLIDATE",
    "FAIR_SHARE",
    "PREEMPTION_REASONS",
    "PRIORITY",
    "RECLAIM",
    "UNSET",
    "Admission",
    "Consequences",
    "FairShareMove",
    "FlavorQuota",
    "FrozenMap",
    "Node",
    "Plan",
    "Preemption",
    "PriorityClass",
    "Queue",
    "QueueStatus",
    "QuotaChange",
    "Resize",
    "ScenarioError",
    "Snapshot",
    "Unset",
    "Waiting",
    "Workload",
    "apply_changes",
    "changes_from_list",
    "changes_to_list",
    "check_snapshot",
    "collector_paused",
    "consequences_to_dict",
    "diff",
    "minimum_runtimes",
    "plan",
    "plan_to_dict",
    "snapshot_from_dict",
    "snapshot_to_dict",
    "usage_words",
]

"""Who the local runtime runs ranks as: a user and a group of the job's own.

The runner account (QM_RUNNER_USER, `qm-runner` by default, created by `bin/runner-user`)
is the name ranks carry (USER, LOGNAME) and the unprivileged user whose reach to the
interpreter and the repository `bin/runner-user` checks. Each job's ranks run with ids of
their own: job N as uid and gid `gid_base + N`, its only group. Nothing needs to exist in
/etc/passwd or /etc/group for that: the kernel checks numbers. Two jobs are then neither
each other's owner nor in each other's group, so the kernel keeps them apart: the folders
(see local.py for the ones the group guards), /proc/<pid>/environ, /proc/<pid>/mem and
/proc/<pid>/cwd of another job's rank (ptrace_may_access needs the same uid and gid), and
signals, which an unprivileged process may send only to processes of its own uid.

Switching users, handing folders to the job's group and signalling the ranks needs root:
without it there is no runner, and the reason says why.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass

# The first id handed to jobs: job N runs as uid and gid DEFAULT_GID_BASE + N. It sits
# above the ranges that distributions, systemd and directory services hand out (all
# below 2**31), so no job's ids are those of some real user or group that files
# elsewhere belong to.
DEFAULT_GID_BASE = 2**31

# The largest user or group id the kernel accepts; (uid_t)-1 means "unchanged" to
# setuid() and setgid().
MAX_GID = 2**32 - 2


@dataclass(frozen=True, slots=True)
class RunnerAccount:
    """The unprivileged user ranks are named after, and where the per-job ids start."""

    name: str
    uid: int
    gid_base: int = DEFAULT_GID_BASE

    def job_gid(self, job_id: int) -> int:
        """The group every rank, folder and checkpoint of this job belongs to."""
        gid = self.gid_base + job_id
        if job_id < 0 or gid > MAX_GID:
            raise ValueError(
                f"job {job_id} has no group id: {self.gid_base} + {job_id} is past {MAX_GID}"
            )
        return gid

    def job_uid(self, job_id: int) -> int:
        """The user every rank of this job runs as: the same number as its group."""
        return self.job_gid(job_id)


@dataclass(frozen=True, slots=True)
class RunnerLookup:
    """The outcome of looking the runner up: an account, or why there is none."""

    account: RunnerAccount | None
    reason: str


def find_runner(name: str, *, gid_base: int = DEFAULT_GID_BASE) -> RunnerLookup:
    """The runner account named `name`, when this process may run ranks as it."""
    if not name:
        return RunnerLookup(None, "QM_RUNNER_USER is empty")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return RunnerLookup(
            None, f"there is no user {name!r} (bin/runner-user creates it when run as root)"
        )
    if entry.pw_uid == 0:
        return RunnerLookup(None, f"the user {name!r} is root, which isolates nothing")
    if entry.pw_uid == os.geteuid():
        return RunnerLookup(
            None, f"the control plane itself runs as {name!r}, so ranks could read its files"
        )
    if os.geteuid() != 0:
        return RunnerLookup(
            None,
            f"the control plane runs as uid {os.geteuid()}, not root: starting ranks as "
            f"{name!r}, giving folders to a job's group and signalling the ranks need root",
        )
    if not 0 < gid_base <= MAX_GID:
        return RunnerLookup(None, f"the group id base {gid_base} is out of range")
    return RunnerLookup(RunnerAccount(name=name, uid=entry.pw_uid, gid_base=gid_base), "")

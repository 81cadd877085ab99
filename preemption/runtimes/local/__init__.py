"""The local runtime: every rank a real OS process on this machine.

Each rank runs in its own session and process group, started by a keeper process (see
launcher.py) that waits on it and records its pid, start time and exit code on disk under
`<root>/<job_id>/<attempt>/<rank>/` (layout in records.py). The runtime object holds no
state of its own: a fresh LocalRuntime over the same root, in another process or after a
restart, observes exactly what the previous one did. Nodes are virtual: they come from a
configured inventory and label the ranks. Each rank is given GPU indices of its node that
no other live gang there holds, recorded in gang.json, and sees only those through
CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES (gpu_slots.py).

Isolation. A rank runs a researcher's command, so it must not reach the control plane's
secret key, database or processes, nor another job's files. Given a runner account (see
runner.py: one unprivileged user, plus a group id of the job's own), the keeper stays
root, so it can record and signal as before, and drops privileges only for the rank:
the rank runs as the runner user with the job's group as its only group, umask 077,
no way back to privileges through setuid programs (PR_SET_NO_NEW_PRIVS), `HOME`,
`TMPDIR` and working folder set to its private folder, and an environment built from
scratch (launcher.rank_environment). The folders, all made by this runtime:

    <root>/                           control plane, 0711: nobody else may list the jobs
    <root>/gangs/                     control plane, 0700: the index of live gangs and
                                      their master ports (records.py)
    <root>/gpus/                      control plane, 0700: a lock file per node, held
                                      while a launch picks its GPUs (gpu_slots.py)
    <root>/<job>/                     control plane, group = the job's, 0710: the job's
                                      ranks may pass through it, no other job's may
    <root>/<job>/<attempt>/           control plane, 0711: gang.json (which holds the
                                      job's events token) and launcher.log are 0600
    <root>/<job>/<attempt>/<rank>/    control plane, 0711: the records and rank.log are
                                      0600; the rank writes into a pipe that its keeper
                                      copies into the log, keeping its head and tail
                                      (capped_log.py), so the rank cannot forge its
                                      records nor fill the disk
    .../<rank>/work/                  the job's user and group, 0700: the private
                                      folder the rank works in
    $QM_CHECKPOINT_DIR                control plane, group = the job's, 0770: the ranks
                                      of every attempt of the job write checkpoints there;
                                      the control plane (root) reads them
    <root>/<job>/<attempt>/preemption-mtbp
                                      control plane, group = the job's, 0640: the cadence
                                      hint (QM_PREEMPTION_MTBP_FILE), replaced by rename

The cadence hint is written by the control plane, which runs as root, into a folder a
job's rank can pass through but not write; it is written through folder descriptors
opened without following links, each checked to be the control plane's own, under a
fresh name created exclusively, then renamed over the old file (a rename replaces a
link in its place, never the file a link points to). So neither a link planted in
the gang's path nor one at the file's name can turn the write to another job's files.

Every job's ranks run as a uid and gid of the job's own (runner.py), so another job's
rank is neither the owner nor in the group of `<root>/<job>/` or of the checkpoint
folder, and the kernel refuses it at the door, whatever lies behind. The same ids keep
jobs out of each other's processes: the kernel lets one process read another's
/proc/<pid>/environ (where the events token is) only when uid and gid both match, and
an unprivileged process may signal only processes of its own uid. The control plane's
own processes run as another uid altogether. What remains shared is the host network
and world-writable places such as /tmp (a rank's TMPDIR is its own folder); where
tenants must not be able to disturb each other at all, the Kubernetes runtime puts every
rank in a container of its own.

Running ranks as another user needs root: the keeper switches uid and gid, folders are
handed to a job's group, and the control plane signals and inspects processes of
another uid. (The capabilities that adds up to, CAP_SETUID, CAP_SETGID, CAP_CHOWN,
CAP_FOWNER, CAP_KILL, CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE, are most of root anyway,
so root is the one setup supported and tested; runner.find_runner checks for it.) Without a runner account the ranks run as the control plane's user, in the
same folders and with the same clean environment; `preemption.runtime` refuses that in
production and warns once elsewhere. The ranks must be able to reach the Python interpreter
and the code the commands name, as any other user; `bin/runner-user` checks that with
the runner account and grants it.

The package's modules: ``runtime`` (LocalRuntime), ``folders`` (the control plane's
folders and the cadence hint file), ``index`` (the index of live gangs), ``scan``
(a gang's processes in the process table), ``observe`` (a rank's state from its
records), ``exits`` (the pipe keepers announce exits on), ``launch_server`` (the
client of the launcher that forks keepers) and ``ports``.
"""

from preemption.runtimes.local.runtime import LocalRuntime
from preemption.runtimes.local.scan import GangProcess

__all__ = ["GangProcess", "LocalRuntime"]

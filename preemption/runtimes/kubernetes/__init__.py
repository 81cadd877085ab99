"""The Kubernetes runtime: one bare Pod per rank, evicted as one gang.

Objects of one gang (job id, attempt), all in one namespace:

* a ConfigMap ``qm-<job>-<attempt>``: the gang's record and the owner of every
  other object, so deleting it garbage-collects the gang. Its annotations keep
  what must survive a restart of the worker: when the gang was launched and
  when it was signalled or killed;
* a Secret ``qm-<job>-<attempt>-events`` holding ``QM_EVENTS_TOKEN``;
* a ConfigMap ``qm-<job>-<attempt>-risk`` holding the cadence hint (the gang's
  mean time between preemptions, key ``mtbp``), mounted read-only in every rank at
  ``/var/run/quartermaster/risk``, where ``QM_PREEMPTION_MTBP_FILE`` points. The
  control plane patches it while the gang runs; kubelets refresh ConfigMap
  volumes within about a minute, soon enough for a cadence. A ConfigMap of its
  own rather than a key of the gang record: the record carries the placement
  and the control plane's annotations, none of which a rank needs to read;
* a NetworkPolicy ``qm-<job>-<attempt>`` letting the gang's ranks reach each
  other; the namespace's default-deny policy (``network_policy``) shuts out
  everything else but DNS and the portal's events URL;
* a headless Service ``qm-<job>-<attempt>`` (``publishNotReadyAddresses``), so
  rank 0 resolves as ``rank-0.qm-<job>-<attempt>.<namespace>.svc.<domain>``
  before it is ready: that is ``MASTER_ADDR``;
* a Pod per rank ``qm-<job>-<attempt>-r<rank>``: restartPolicy Never, the
  gang's PriorityClass, terminationGracePeriodSeconds from the class's grace,
  a required node affinity to the node the engine placed it on, and the
  finalizer ``quartermaster.dev/exit-code``. Pods meet the "restricted" Pod
  Security Standard (non-root, no privilege escalation, no capabilities,
  seccomp RuntimeDefault, no service-account token), request and limit CPU,
  memory and ``ephemeral-storage`` by flavor, and mount only their own job's
  folder of the checkpoint volume (see "Checkpoints" below). The finalizer keeps a deleted
  pod's object (with its final container status) until ``forget()``, so an
  exit code is never lost between the kubelet reporting it and a worker
  reading it, even across a worker restart. kube-scheduler stops counting a
  pod's GPUs once its phase is terminal, finalizer or not.

Signalling is the ``policy/v1`` Eviction API for every rank concurrently with
``deleteOptions.gracePeriodSeconds``, once the gang's record says when this
runtime signalled it (``quartermaster.dev/signalled-at``; a kill writes
``quartermaster.dev/killed-at`` before its deletions): an eviction of a rank of a
gang with no such record, or one that began before it, of one rank or of all, is
someone else's (``kubectl drain``, the kubelet, kube-scheduler), a disruption, even
to a worker restarted since; a 429 (a PodDisruptionBudget says no) is
retried with backoff, and a gang still blocked raises RuntimeTemporaryError
and shows in ``eviction_blocked()``; the reconciler retries each cycle and,
once the grace deadline has passed, kills the gang (the preemption is then
"forced past a disruption budget"). Killing deletes every pod with grace 0.

Checkpoints. One ReadWriteMany claim holds every job's checkpoints, so each
rank must reach its own job's folder and nothing else of it:

* every job runs as a uid and gid of its own, ``job_uid_base + job id``
  (``runAsUser``, ``runAsGroup`` and ``fsGroup``), as the local runtime's
  runner does, so the kernel (or the NFS server) keeps two jobs' files apart;
* the rank container mounts the claim with ``subPath`` set to its job's
  folder, the last part of ``QM_CHECKPOINT_DIR`` (``job-<id>-<random>``), at
  ``QM_CHECKPOINT_DIR`` itself: the volume's root and the other jobs' folders
  are not in its filesystem at all;
* the folder must exist with the job's owner before that mount: a kubelet
  creates a missing subPath folder as root (mode copied from the volume root),
  and applies ``fsGroup`` to a volume only where its driver manages ownership,
  and then to the whole shared volume, never to one folder. An init container
  ``checkpoint-folder`` therefore creates it, running as the job's own uid and
  with the claim's root mounted: ``mkdir -m 0700``, then it checks that the
  folder is a directory the job owns (a name someone else took first fails the
  pod rather than sharing a folder). No step needs root or a capability, so the
  pod stays within "restricted", and the control plane mounts no claim itself.
  The root must let any uid create entries without listing or removing
  anyone's: mode ``1733`` (``deploy/checkpoints.yaml`` says how);
* the driver of the claim must not apply ``fsGroup`` to it (``fsGroupPolicy``
  ``None``, or the default ``ReadWriteOnceWithFSType``, which leaves
  ReadWriteMany volumes alone): ``File`` would hand every folder on the volume
  to the group of the last job started.

A planted file in a folder could run code in the job that resumes from it;
gracetrap loads checkpoints without unpickling anything, and this layout keeps
anyone but the job from writing there in the first place.

GPUs come to a rank only through its ``nvidia.com/gpu`` limit: a gang whose env
names ``CUDA_*`` or ``NVIDIA_*`` is refused by ``launch()`` before anything is
created (the submission refuses them already), since NVIDIA's container runtime
reads ``NVIDIA_VISIBLE_DEVICES`` to choose the devices it exposes. The init container asks for no GPU and sets
``NVIDIA_VISIBLE_DEVICES=void``, so an image that says ``all`` gets none there.

This package imports nothing from Django: the portal hands it plain values. Its
modules, each importing only those above it:

* ``config``: the names, labels and annotations of a gang's objects, and the settings;
* ``cluster``: the API clients, thread pool and caches, and the protocol's errors;
* ``spec``: what a rank's pod is (container, env, resources, volumes, security);
* ``policies``: namespaces, NetworkPolicies and the PriorityClass reconcile;
* ``evict``: the signal (an eviction of every rank) and the kill;
* ``observe``: pods listed or watched, read as RankObservations; the gang guard's rule;
* ``logs``: a rank's log, a slice or its tail;
* ``launch``: a gang's objects created at launch and removed at forget;
* ``runtime``: KubernetesRuntime, which hands each protocol call to one of them.
"""

from preemption.runtimes.kubernetes.config import NO_CHECKPOINT_VOLUME, KubernetesRuntimeConfig
from preemption.runtimes.kubernetes.policies import (
    PriorityClassReconcileResult,
    PriorityClassSpec,
    reconcile_priority_classes,
)
from preemption.runtimes.kubernetes.runtime import KubernetesRuntime
from preemption.runtimes.kubernetes.spec import on_checkpoint_volume

__all__ = [
    "NO_CHECKPOINT_VOLUME",
    "KubernetesRuntime",
    "KubernetesRuntimeConfig",
    "PriorityClassReconcileResult",
    "PriorityClassSpec",
    "on_checkpoint_volume",
    "reconcile_priority_classes",
]

"""A ReadWriteMany checkpoint claim on the test control plane.

The test control plane runs no volume provisioner and no PersistentVolume
binder, so this creates a statically bound pair, a PersistentVolume reserved
for the claim and the claim naming it, and writes the Bound status the binder
would write. kube-scheduler then places pods that mount the claim as it would
on a real cluster; the node agent backs the claim with one shared folder.
"""

from __future__ import annotations

from pathlib import Path

from kubernetes import client


def bound_claim(
    api_client: client.ApiClient, namespace: str, name: str, *, host_path: Path | None = None
) -> str:
    """Create claim ``name`` in ``namespace`` bound to a volume of its own; return the volume.

    The volume is a folder of the host (``host_path``) where real kubelets mount it;
    the node agent backs every claim with a folder of its own and only needs the name.
    The claim is made first so that the volume's claimRef carries its uid, as the
    binder writes it: a real kubelet mounts a volume only for the claim named so."""
    core = client.CoreV1Api(api_client)
    volume = f"{namespace}-{name}"
    made = core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {
                "name": name,
                "annotations": {"pv.kubernetes.io/bind-completed": "yes"},
            },
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    source: dict[str, object] = (
        {"nfs": {"server": "nfs.invalid", "path": f"/{volume}"}}
        if host_path is None
        else {"hostPath": {"path": str(host_path), "type": "Directory"}}
    )
    core.create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                # A host's folder is the test's to remove, not a provisioner's.
                "persistentVolumeReclaimPolicy": "Delete" if host_path is None else "Retain",
                "storageClassName": "",
                **source,
                "claimRef": {"namespace": namespace, "name": name, "uid": made.metadata.uid},
            },
        }
    )
    core.patch_persistent_volume_status(volume, {"status": {"phase": "Bound"}})
    core.patch_namespaced_persistent_volume_claim_status(
        name,
        namespace,
        {
            "status": {
                "phase": "Bound",
                "accessModes": ["ReadWriteMany"],
                "capacity": {"storage": "1Gi"},
            }
        },
    )
    return volume


def delete_claim(api_client: client.ApiClient, namespace: str, name: str, volume: str) -> None:
    """Remove a claim and volume made by ``bound_claim``.

    Their protection finalizers are dropped first: the controllers that would
    release them do not run on the test control plane.
    """
    core = client.CoreV1Api(api_client)
    clear = [{"op": "replace", "path": "/metadata/finalizers", "value": []}]
    core.patch_namespaced_persistent_volume_claim(name, namespace, clear)
    core.delete_namespaced_persistent_volume_claim(name, namespace)
    core.patch_persistent_volume(volume, clear)
    core.delete_persistent_volume(volume)

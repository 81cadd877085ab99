"""Container images for real test nodes, built without a registry or a daemon.

Two images, each written as an OCI image layout in a tar that
``ctr -n k8s.io images import`` reads:

* the rank image: the host's own ``sh`` (dash), ``date``, ``sleep`` and ``cat``
  with the shared libraries they load, and empty ``tmp``, ``proc``, ``sys``,
  ``dev`` and ``etc``. It is what a rank pod of the Kubernetes runtime needs:
  ``/bin/sh`` runs the runtime's entrypoint, and a shell workload can trap
  SIGTERM and say when it caught it (``date +%s.%N``). Where the host has a
  static busybox (Debian's busybox-static, which bin/test-services installs), its
  ``nc`` and ``nslookup`` too, so a rank can resolve ``MASTER_ADDR`` through the
  cluster DNS and reach a port of another rank. A few megabytes;
* the pause image: a static build of Kubernetes' pause program (it sleeps as
  the sandbox's PID 1, exits on SIGINT or SIGTERM and reaps zombies).

Both are cached by the hash of what went in, under
``${QM_IMAGE_CACHE:-~/.cache/quartermaster/images}``, so a second run only
imports them. Their names carry that hash as the tag: a pod asking for
``IfNotPresent`` never tries to pull a tag the node already has.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RANK_REPOSITORY = "quartermaster.test/rank"
PAUSE_REPOSITORY = "quartermaster.test/pause"
RANK_TOOLS = ("sh", "date", "sleep", "cat")
# Debian's busybox-static; its applets are links to it in the image.
BUSYBOX = Path("/bin/busybox")
BUSYBOX_APPLETS = ("nc", "nslookup")

# Kubernetes' pause.c, reduced: PID 1 of every pod sandbox.
PAUSE_SOURCE = r"""
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void sigdown(int signo) { (void)signo; _exit(0); }

static void sigreap(int signo) {
    (void)signo;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction down = {.sa_handler = sigdown};
    struct sigaction reap = {.sa_handler = sigreap, .sa_flags = SA_NOCLDSTOP};
    if (sigaction(SIGINT, &down, NULL) < 0 || sigaction(SIGTERM, &down, NULL) < 0 ||
        sigaction(SIGCHLD, &reap, NULL) < 0) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
"""


class ImageBuildError(RuntimeError):
    """An image could not be built."""


@dataclass(frozen=True)
class BuiltImage:
    """An image archive on disk and the name it is imported under."""

    name: str
    archive: Path


def cache_dir() -> Path:
    """Where built image archives are kept between runs."""
    default = Path.home() / ".cache" / "quartermaster" / "images"
    return Path(os.environ.get("QM_IMAGE_CACHE", default))


def _library_closure(binary: Path) -> list[Path]:
    """The shared libraries (and the loader) ``binary`` needs, as ldd names them."""
    result = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return []  # a static binary
    found = []
    for line in result.stdout.splitlines():
        match = re.search(r"(/\S+)", line)
        if match:
            found.append(Path(match.group(1)))
    return found


def _canonical(path: Path) -> str:
    """The path inside the image: merged /usr, like the host, without a leading slash."""
    text = str(path).lstrip("/")
    for top in ("bin", "lib", "lib64", "sbin"):
        if text == top or text.startswith(f"{top}/"):
            return f"usr/{text}"
    return text


def static_busybox() -> Path | None:
    """The host's busybox when it is a static binary (one file, no libraries), else None."""
    if not BUSYBOX.exists():
        return None
    real = BUSYBOX.resolve()
    return real if not _library_closure(real) else None


def _rank_files() -> dict[str, Path]:
    """Image path -> host file (resolved) for the rank image."""
    files: dict[str, Path] = {}
    busybox = static_busybox()
    if busybox is not None:
        files["usr/bin/busybox"] = busybox
    for tool in RANK_TOOLS:
        found = shutil.which(tool)
        if found is None:
            raise ImageBuildError(f"the host has no {tool} to put in the rank image")
        real = Path(found).resolve()
        files[f"usr/bin/{tool}"] = real
        for library in _library_closure(real):
            files[_canonical(library)] = library.resolve()
    return files


def _layer(files: dict[str, Path], symlinks: dict[str, str], dirs: dict[str, int]) -> bytes:
    """A reproducible uncompressed tar layer."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        parents: set[str] = set()
        for path in sorted(files):
            parts = path.split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                parents.add("/".join(parts[:depth]))
        for directory in sorted(parents | set(dirs)):
            info = tarfile.TarInfo(directory)
            info.type = tarfile.DIRTYPE
            info.mode = dirs.get(directory, 0o755)
            tar.addfile(info)
        for link, target in sorted(symlinks.items()):
            info = tarfile.TarInfo(link)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            info.mode = 0o777
            tar.addfile(info)
        for path, source in sorted(files.items()):
            data = source.read_bytes()
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mode = 0o755
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _oci_archive(name: str, layer: bytes, entrypoint: list[str], target: Path) -> None:
    """Write an OCI image layout tar holding one single-layer image called ``name``."""
    layer_digest = hashlib.sha256(layer).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": entrypoint, "WorkingDir": "/", "Env": ["PATH=/usr/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
        },
        sort_keys=True,
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": f"sha256:{hashlib.sha256(config).hexdigest()}",
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": f"sha256:{layer_digest}",
                    "size": len(layer),
                }
            ],
        },
        sort_keys=True,
    ).encode()
    index = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": f"sha256:{hashlib.sha256(manifest).hexdigest()}",
                    "size": len(manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                    },
                }
            ],
        },
        sort_keys=True,
    ).encode()
    entries = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": index,
        **{
            f"blobs/sha256/{hashlib.sha256(blob).hexdigest()}": blob
            for blob in (layer, config, manifest)
        },
    }
    partial = target.with_suffix(".partial")
    with tarfile.open(partial, mode="w") as tar:
        for directory in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(directory)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        for path, data in entries.items():
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    partial.replace(target)


def _cached(repository: str, digest: str, build: Callable[[str, Path], None]) -> BuiltImage:
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    tag = digest[:16]
    name = f"{repository}:{tag}"
    archive = folder / f"{repository.rsplit('/', 1)[1]}-{tag}.tar"
    if not archive.exists():
        build(name, archive)
    return BuiltImage(name=name, archive=archive)


def rank_image() -> BuiltImage:
    """The rank image, built from the host's tools unless one of the same content is cached."""
    files = _rank_files()
    hasher = hashlib.sha256()
    for path, source in sorted(files.items()):
        hasher.update(path.encode() + b"\0" + hashlib.sha256(source.read_bytes()).digest())
    symlinks = {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64", "sbin": "usr/sbin"}
    if "usr/bin/busybox" in files:
        symlinks |= {f"usr/bin/{applet}": "busybox" for applet in BUSYBOX_APPLETS}
        hasher.update(" ".join(BUSYBOX_APPLETS).encode())
    dirs = {"tmp": 0o1777, "proc": 0o555, "sys": 0o555, "dev": 0o755, "etc": 0o755}

    def build(name: str, archive: Path) -> None:
        _oci_archive(name, _layer(files, symlinks, dirs), ["/bin/sh"], archive)

    return _cached(RANK_REPOSITORY, hasher.hexdigest(), build)


def pause_image() -> BuiltImage:
    """The sandbox image: a static pause program, compiled unless cached."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise ImageBuildError("no C compiler to build the pause program")
    digest = hashlib.sha256(PAUSE_SOURCE.encode()).hexdigest()

    def build(name: str, archive: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="qm-pause-") as work:
            source = Path(work) / "pause.c"
            source.write_text(PAUSE_SOURCE)
            binary = Path(work) / "pause"
            result = subprocess.run(
                [compiler, "-Os", "-static", "-o", str(binary), str(source)],
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode != 0:
                raise ImageBuildError(f"pause did not compile: {result.stderr[-2000:]}")
            layer = _layer({"pause": binary}, {}, {})
            _oci_archive(name, layer, ["/pause"], archive)

    return _cached(PAUSE_REPOSITORY, digest, build)

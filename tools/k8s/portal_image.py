"""The portal image, built from the project's own ``Containerfile`` without a registry.

Why this module exists: no Python library builds a Containerfile (a multi-stage
build with ``RUN`` steps needs a container runtime and a layer store), and the
machines the tests run on reach no image registry, so the Containerfile's default
``PYTHON_IMAGE`` (``docker.io/library/python:3.11-slim-bookworm``) cannot be pulled.
What the machines do reach are the package registries: Debian's archive, as apt
is configured on the host, and PyPI. So the build runs in three steps, each one a
tool from Debian 12 driven from here:

* base: ``mmdebstrap`` makes a Debian bookworm root filesystem from the host's
  own apt sources with Python 3.11 (the project's), ``venv``, the C headers the
  fair-share engine's mypyc build needs (the slim image has them, Debian's
  ``python3`` has not), ``passwd`` for the runtime stage's ``useradd`` and the CA
  bundle; ``buildah`` turns that tar into an image used as ``PYTHON_IMAGE``.
  It is kept in buildah's store, tagged by the hash of its recipe (the package
  list, the apt sources, the extra CAs), so it is made once per machine;
* build: ``buildah build --layers`` of the Containerfile, with the host's network
  so ``pip install`` reaches PyPI and ``apt-get install gcc`` reaches Debian. The
  context is a copy of the tracked files that ``.containerignore`` leaves, with
  one fixed mtime and git's modes: buildah's layer cache keys a ``COPY`` on the
  files' times and modes as well as their content, and a fresh clone has new
  times, so without this the dependency layer (``COPY pyproject.toml`` and the
  ``pip install`` after it, most of the build) would be rebuilt in every clone;
* export: ``buildah push`` to an ``oci-archive``, which ``ctr -n k8s.io images
  import`` reads. It is named ``quartermaster.test/portal:<hash>``, the hash of
  the Containerfile, ``.containerignore``, the context and the base's recipe, and
  cached as ``${QM_IMAGE_CACHE:-~/.cache/quartermaster/images}/portal-<hash>.tar``
  (beside the rank and pause images of ``tools/k8s/images.py``); a second call
  with the same inputs finds it and returns at once.

The proxy: PyPI is reached here through a TLS-intercepting proxy whose CA is
not Debian's. It lies in ``/usr/local/share/ca-certificates`` (and so, after
``update-ca-certificates``, in ``/etc/ssl/certs/ca-certificates.crt``), and the
host's pip is pointed at that bundle (``PIP_CERT``). A fresh root filesystem
knows none of this, so the base gets the host's extra CAs copied in and
``update-ca-certificates`` run in a customize hook, and an ``/etc/pip.conf``
whose ``cert`` is the system bundle: pip inside the build (the Containerfile's
virtualenvs read ``/etc/pip.conf``) then trusts the proxy, and the CAs are part
of the base's hash. Debian's archive is plain HTTP (apt checks signatures), so
apt needs nothing. The image shipped from a real registry would not carry these
CAs; this one is for test clusters on this kind of machine.

Buildah's store stays where buildah keeps it (``/var/lib/containers`` as root),
outside the clone, so its layers serve every fresh clone on the machine. Builds
run as root without a daemon; ``BUILDAH_ISOLATION=chroot`` picks buildah's
chroot isolation where its default (``oci``, runc) cannot run.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tools.k8s.images import ImageBuildError, cache_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
PORTAL_REPOSITORY = "quartermaster.test/portal"
BASE_REPOSITORY = "quartermaster.test/python-base"
SUITE = "bookworm"
# What the Containerfile's stages run on top of the base: ``python -m venv`` and
# pip (python3-venv, python-is-python3), the mypyc build of the engine (the
# headers of python3.11-dev; gcc and libc6-dev it installs itself with apt),
# ``groupadd`` and ``useradd`` (passwd) and TLS to PyPI (ca-certificates).
BASE_PACKAGES = (
    "python3",
    "python3-venv",
    "python-is-python3",
    "python3.11-dev",
    "passwd",
    "ca-certificates",
)
# The host's apt sources, the first that exists: the build's ``apt-get update``
# uses them too, since mmdebstrap writes them into the root filesystem.
HOST_APT_SOURCES = (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list"))
EXTRA_CAS = Path("/usr/local/share/ca-certificates")
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
PIP_CONF = f"[global]\ncert = {SYSTEM_BUNDLE}\n"
BASE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")
# Each tool this module runs and the Debian 12 package it comes in.
TOOLS = {"mmdebstrap": "mmdebstrap", "buildah": "buildah"}
# Every file and folder of the build context gets this mtime (2000-01-01), so the
# layer cache holds across clones. Not 0: the gracetrap wheel is a zip, and zip
# has no times before 1980.
CONTEXT_MTIME = 946684800
HASH_LENGTH = 16


@dataclass(frozen=True)
class PortalImage:
    """An archive of the portal image, the name it imports under, and what it took.

    ``size_bytes`` is the archive's size (its layers gzip-compressed). The seconds
    are those of this call: all zero but the hashing when the archive was cached.
    """

    archive: Path
    name: str
    size_bytes: int
    cached: bool
    base_seconds: float
    build_seconds: float
    export_seconds: float


# -- the build context: what .containerignore leaves of the tracked files -------


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    """A .containerignore pattern as a regex over a slash-separated relative path.

    As in Docker's and buildah's matcher: ``*`` and ``?`` stop at a slash, ``**``
    crosses any number of folders, and a pattern that names a folder matches
    everything below it.
    """
    pattern = pattern.strip("/")
    regex = ""
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if pattern.startswith("**/", index):
            regex += "(?:.*/)?"
            index += 3
            continue
        if pattern.startswith("**", index):
            regex += ".*"
            index += 2
            continue
        if char == "*":
            regex += "[^/]*"
        elif char == "?":
            regex += "[^/]"
        elif char == "[":
            end = pattern.find("]", index + 1)
            if end == -1:
                regex += re.escape(char)
            else:
                regex += pattern[index : end + 1].replace("\\", "\\\\")
                index = end
        else:
            regex += re.escape(char)
        index += 1
    return re.compile(f"{regex}(?:/.*)?")


def ignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """The rules of a .containerignore: (excludes, regex) in order, ``!`` re-including."""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        rules.append((not include, _ignore_regex(line.lstrip("!").strip())))
    return rules


def is_ignored(path: str, rules: Sequence[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether ``path`` is left out of the context: the last rule that matches decides."""
    ignored = False
    for excludes, regex in rules:
        if regex.fullmatch(path):
            ignored = excludes
    return ignored


@dataclass(frozen=True)
class ContextFile:
    """A tracked file copied into the build context."""

    path: str
    mode: int  # 0o644, 0o755, or 0 for a symlink
    content: bytes  # a symlink's target


def context_files(root: Path) -> list[ContextFile]:
    """The tracked files (as they are in the work tree) that .containerignore leaves.

    Untracked files stay out, so a stray ``var/`` or an editor's backup never
    changes the image, and the modes are git's, not the checkout's umask's.
    """
    ignore = root / ".containerignore"
    rules = ignore_rules(ignore.read_text() if ignore.exists() else "")
    listing = subprocess.run(
        ["git", "ls-files", "--stage", "-z"], cwd=root, capture_output=True, check=True
    ).stdout.decode()
    files = []
    for entry in filter(None, listing.split("\0")):
        meta, path = entry.split("\t", 1)
        git_mode = meta.split()[0]
        source = root / path
        if git_mode == "160000" or is_ignored(path, rules):
            continue  # a submodule, or a file the image does not need
        if source.is_symlink():
            files.append(ContextFile(path, 0, os.readlink(source).encode()))
        elif source.is_file():  # not deleted in the work tree
            mode = 0o755 if git_mode == "100755" else 0o644
            files.append(ContextFile(path, mode, source.read_bytes()))
    return sorted(files, key=lambda file: file.path)


def _write_context(files: Sequence[ContextFile], target: Path) -> None:
    """Write the files under ``target`` with fixed times, so equal content caches equally."""
    folders = {target}
    for file in files:
        destination = target / file.path
        for parent in destination.relative_to(target).parents:
            folders.add(target / parent)
        destination.parent.mkdir(parents=True, exist_ok=True)
        if file.mode == 0:
            destination.symlink_to(file.content.decode())
            os.utime(destination, (CONTEXT_MTIME, CONTEXT_MTIME), follow_symlinks=False)
        else:
            destination.write_bytes(file.content)
            destination.chmod(file.mode)
            os.utime(destination, (CONTEXT_MTIME, CONTEXT_MTIME))
    for folder in folders:
        folder.chmod(0o755)
        os.utime(folder, (CONTEXT_MTIME, CONTEXT_MTIME))


# -- the tools ------------------------------------------------------------------


def _ensure_tools() -> None:
    """Install the Debian packages of the tools that are missing (as root), or say which."""
    missing = sorted({package for tool, package in TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise ImageBuildError(f"the portal image needs {' '.join(missing)} (apt-get install)")
    install = ["apt-get", "install", "-y", "-q", *missing]
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # A package missing from stale lists is found after an update.
    if subprocess.run(install, env=environment, capture_output=True, check=False).returncode:
        _run(["apt-get", "update", "-q"], "apt-get update")
        _run(install, "apt-get install", env=environment)


def _run(command: Sequence[str], step: str, *, env: dict[str, str] | None = None) -> str:
    """Run ``command``; its output, or an ImageBuildError with the end of it."""
    result = subprocess.run(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False, env=env
    )
    if result.returncode != 0:
        raise ImageBuildError(f"{step} failed ({result.returncode}):\n{result.stdout[-4000:]}")
    return result.stdout


def _image_exists(name: str) -> bool:
    return (
        subprocess.run(
            ["buildah", "inspect", "--type", "image", name], capture_output=True, check=False
        ).returncode
        == 0
    )


# -- base: a Debian root filesystem as PYTHON_IMAGE -----------------------------


def _apt_sources() -> Path:
    for sources in HOST_APT_SOURCES:
        if sources.exists():
            return sources
    raise ImageBuildError(f"no apt sources on this host (looked for {HOST_APT_SOURCES})")


def _base_command(rootfs: Path) -> list[str]:
    """The mmdebstrap command line; its hooks carry the proxy's CAs and pip's setting."""
    copy_cas = [
        f"--customize-hook=copy-in {certificate} {EXTRA_CAS}/"
        for certificate in sorted(EXTRA_CAS.glob("*.crt"))
    ]
    pip_conf = " ".join(f"'{line}'" for line in PIP_CONF.splitlines())
    return [
        "mmdebstrap",
        "--quiet",
        "--variant=apt",
        f"--include={','.join(BASE_PACKAGES)}",
        *copy_cas,
        '--customize-hook=chroot "$1" update-ca-certificates',
        f"--customize-hook=printf '%s\\n' {pip_conf} >\"$1/etc/pip.conf\"",
        SUITE,
        str(rootfs),
        str(_apt_sources()),
    ]


def base_name() -> str:
    """The base image's name: its tag is the hash of its recipe (not of what apt fetched)."""
    hasher = hashlib.sha256()
    hasher.update("\0".join(_base_command(Path("rootfs.tar"))).encode())
    hasher.update("\0".join(BASE_ENV).encode())
    hasher.update(_apt_sources().read_bytes())
    for certificate in sorted(EXTRA_CAS.glob("*.crt")):
        hasher.update(certificate.name.encode() + b"\0" + certificate.read_bytes())
    return f"{BASE_REPOSITORY}:{hasher.hexdigest()[:HASH_LENGTH]}"


def _build_base(name: str) -> None:
    with tempfile.TemporaryDirectory(prefix="qm-base-") as work:
        rootfs = Path(work) / "rootfs.tar"
        _run(_base_command(rootfs), "mmdebstrap")
        container = _run(["buildah", "from", "scratch"], "buildah from").strip()
        try:
            _run(["buildah", "add", "--quiet", container, str(rootfs), "/"], "buildah add")
            environment = [arg for pair in BASE_ENV for arg in ("--env", pair)]
            _run(
                ["buildah", "config", *environment, "--cmd", '["python3"]', container],
                "buildah config",
            )
            _run(["buildah", "commit", "--quiet", container, name], "buildah commit")
        finally:
            subprocess.run(["buildah", "rm", container], capture_output=True, check=False)


# -- build and export -------------------------------------------------------------


def portal_tag(files: Sequence[ContextFile], containerfile: bytes, base: str) -> str:
    """The hash of everything the image is made from."""
    hasher = hashlib.sha256()
    hasher.update(base.encode() + b"\0" + containerfile + b"\0")
    for file in files:
        hasher.update(f"{file.path}\0{file.mode:o}\0".encode())
        hasher.update(hashlib.sha256(file.content).digest())
    return hasher.hexdigest()[:HASH_LENGTH]


@contextmanager
def _lock(folder: Path) -> Iterator[None]:
    """One build at a time per cache: a second caller waits, then finds the archive."""
    with (folder / "portal.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_portal_image(*, root: Path = REPO_ROOT, quiet: bool = True) -> PortalImage:
    """The portal image as an OCI archive, built unless one of the same inputs is cached.

    ``quiet=False`` lets the steps' output through to this process's stdout and
    stderr (the CLI's choice); quietly, a failed step's output ends up in the
    ImageBuildError.
    """
    started = time.monotonic()
    files = context_files(root)
    containerfile = (root / "Containerfile").read_bytes()
    base = base_name()
    tag = portal_tag(files, containerfile, base)
    name = f"{PORTAL_REPOSITORY}:{tag}"
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / f"portal-{tag}.tar"
    if archive.exists():
        return PortalImage(archive, name, archive.stat().st_size, True, 0.0, 0.0, 0.0)
    with _lock(folder):
        if archive.exists():  # built by the caller we waited for
            return PortalImage(archive, name, archive.stat().st_size, True, 0.0, 0.0, 0.0)
        _ensure_tools()
        if not _image_exists(base):
            _build_base(base)
        base_seconds = time.monotonic() - started

        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="qm-portal-context-") as context:
            _write_context(files, Path(context))
            build = [
                "buildah",
                "build",
                "--layers",
                "--pull=never",
                "--network=host",
                f"--isolation={os.environ.get('BUILDAH_ISOLATION', 'oci')}",
                f"--build-arg=PYTHON_IMAGE={base}",
                f"--file={root / 'Containerfile'}",
                f"--tag={name}",
                context,
            ]
            if quiet:
                _run(build, "buildah build")
            else:
                subprocess.run(build, check=True, stdout=sys.stderr)
        build_seconds = time.monotonic() - started

        started = time.monotonic()
        partial = archive.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        _run(["buildah", "push", "--quiet", name, f"oci-archive:{partial}:{name}"], "buildah push")
        partial.replace(archive)
        export_seconds = time.monotonic() - started
    return PortalImage(
        archive,
        name,
        archive.stat().st_size,
        False,
        base_seconds,
        build_seconds,
        export_seconds,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.k8s.portal_image",
        description="Build the portal's Containerfile into an OCI archive (cached by its inputs).",
    )
    parser.add_argument("--quiet", action="store_true", help="hide the build's own output")
    arguments = parser.parse_args(argv)
    try:
        image = build_portal_image(quiet=arguments.quiet)
    except (ImageBuildError, subprocess.CalledProcessError) as error:
        print(f"portal image: {error}", file=sys.stderr)
        return 1
    print(f"archive: {image.archive}")
    print(f"image:   {image.name}")
    print(f"size:    {image.size_bytes / 1e6:.1f} MB ({image.size_bytes} bytes)")
    if image.cached:
        print("cached:  the archive of these inputs was already built")
    print(
        f"seconds: base {image.base_seconds:.1f}, build {image.build_seconds:.1f}, "
        f"export {image.export_seconds:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

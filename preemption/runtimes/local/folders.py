"""The control plane's folders under the local runtime's root, made and opened safely.

Each folder is opened without following links and checked to be the control plane's
own before its group or mode is set or anything is written under it (the package
docstring lays the folders out). It starts no process and reads no record.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import stat
from collections.abc import Sequence
from pathlib import Path

from preemption.runtimes.base import GangId, RuntimePermanentError

# The cadence hint's file in the gang's folder (QM_PREEMPTION_MTBP_FILE).
MTBP_FILE = "preemption-mtbp"


def gang_folder(root: Path, gang: GangId) -> Path:
    """The folder under ``root`` holding the gang's records and logs."""
    return root / str(gang.job_id) / str(gang.attempt)


def control_plane_folder(path: Path, mode: int, *, group: int | None = None) -> None:
    """Create a folder of the control plane's unless it exists, then set its group and mode.

    It is opened without following links and must be a folder this process owns: a link
    or someone else's folder in its place is refused, never handed to a job's group.
    """
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        raise RuntimePermanentError(f"{path} is not a folder: {error}") from error
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise RuntimePermanentError(
                f"{path} belongs to uid {info.st_uid}, not to the control plane ({os.geteuid()})"
            )
        if group is not None and info.st_gid != group:
            os.fchown(fd, -1, group)
        if stat.S_IMODE(info.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def open_control_plane_path(root: Path, names: Sequence[str]) -> int:
    """A descriptor of ``root/names[0]/names[1]/...``, each step opened without following
    a link and checked to be a folder this process owns; anything else is refused."""
    try:
        folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        raise RuntimePermanentError(f"{root} is not a folder: {error}") from error
    path = root
    try:
        for name in ("", *names):
            if name:
                path = path / name
                try:
                    inner = os.open(
                        name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder
                    )
                except OSError as error:
                    if error.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise RuntimePermanentError(
                            f"refused to write under {path}: it is not a folder ({error.strerror})"
                        ) from error
                    raise
                os.close(folder)
                folder = inner
            owner = os.fstat(folder).st_uid
            if owner != os.geteuid():
                raise RuntimePermanentError(
                    f"refused to write under {path}: it belongs to uid {owner}, "
                    f"not to the control plane ({os.geteuid()})"
                )
    except BaseException:
        os.close(folder)
        raise
    return folder


def write_cadence_hint(root: Path, gang: GangId, text: bytes, gid: int | None) -> None:
    """Write ``text`` as the gang's cadence hint file, unless it already says the same:
    under a fresh name created exclusively, through folder descriptors checked to be
    the control plane's own, then renamed over the old file (package docstring)."""
    folder = open_control_plane_path(root, (str(gang.job_id), str(gang.attempt)))
    try:
        with contextlib.suppress(OSError):
            current = os.open(MTBP_FILE, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
            try:
                if os.read(current, 64) == text:
                    return
            finally:
                os.close(current)
        temporary = f".{MTBP_FILE}.{os.getpid()}.{random.getrandbits(32):08x}"
        # O_EXCL never follows a link at the name: the file is a new one of ours.
        out = os.open(
            temporary,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
            0o600,
            dir_fd=folder,
        )
        try:
            try:
                if gid is not None:
                    os.fchown(out, -1, gid)
                os.fchmod(out, 0o600 if gid is None else 0o640)
                os.write(out, text)
            finally:
                os.close(out)
            os.replace(temporary, MTBP_FILE, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=folder)
            raise
    finally:
        os.close(folder)

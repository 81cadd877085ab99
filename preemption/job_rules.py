"""The rules a job's free-text fields must keep to ever run: environment
variables, the image reference (and the teams' image allow-lists), and the
size of the command and name.

Each function returns the reasons a value is refused (empty when it is fine),
so `job_submit` can gather every field's reasons into one 400 answer.

The image reference is checked against the grammar of the distribution
project's reference package (github.com/distribution/reference, the grammar
that Docker, containerd and Kubernetes parse image names with), written out as
one regular expression below. It is hand-written because no small, kept
Python package parses references: the usual candidates are a whole Docker or
registry client, far more than one regular expression's worth of code.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

# POSIX portable environment names: letters, digits and underscores, not
# starting with a digit. Anything else (`=` above all) cannot be passed through
# execve() as a name and broke the rank keeper when it tried.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
# The runtimes own these: the trap's variables (job id, attempt, events token
# and URL, checkpoint folder, grace) and the rendezvous of torch.distributed.
# A job that set them could post events as another attempt or break its gang.
RESERVED_ENV_PREFIX = "QM_"
RESERVED_ENV_NAMES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"})
# The GPU runtime's own: the runtime gives each rank CUDA_VISIBLE_DEVICES for
# the GPUs placed on it, and NVIDIA's container runtime reads NVIDIA_* (above
# all NVIDIA_VISIBLE_DEVICES) to choose the devices it exposes. A job that set
# them could reach GPUs other jobs were given.
RESERVED_GPU_ENV_PREFIXES = ("CUDA_", "NVIDIA_")
MAX_ENV_VARS = 200
MAX_ENV_NAME = 255
# Linux refuses one argument or variable longer than 128 KiB (MAX_ARG_STRLEN);
# a quarter of that per value and the whole of it for all of them leaves room
# for the runtime's own variables.
MAX_ENV_VALUE = 32_768
MAX_ENV_TOTAL = 131_072

MAX_COMMAND = 20_000
MAX_NAME = 120
MAX_IMAGE = 300
# distribution/reference caps the repository name (domain and path) at 255.
MAX_IMAGE_NAME = 255

_ALPHANUMERIC = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALPHANUMERIC}(?:{_SEPARATOR}{_ALPHANUMERIC})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_NAME = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*"
_IPV6 = r"\[(?:[a-fA-F0-9:]+)\]"
_DOMAIN = rf"(?:{_DOMAIN_NAME}|{_IPV6})(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::{_TAG})?(?:@{_DIGEST})?", re.ASCII)


def env_errors(env: Mapping[str, str]) -> list[str]:
    """Why these environment variables cannot be given to a job's ranks."""
    errors: list[str] = []
    if len(env) > MAX_ENV_VARS:
        return [f"At most {MAX_ENV_VARS} variables (got {len(env)})."]
    total = 0
    for name, value in env.items():
        shown = name[:40] + ("…" if len(name) > 40 else "")
        if len(name) > MAX_ENV_NAME:
            errors.append(f"Name {shown!r} is longer than {MAX_ENV_NAME} characters.")
        elif not ENV_NAME.fullmatch(name):
            errors.append(
                f"Name {shown!r} is not a portable environment name: letters, digits and "
                "underscores, not starting with a digit."
            )
        elif name.startswith(RESERVED_ENV_PREFIX) or name in RESERVED_ENV_NAMES:
            errors.append(
                f"{name} is set by the runtime for every rank (QM_* and the rendezvous "
                "variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."
            )
        elif name.upper().startswith(RESERVED_GPU_ENV_PREFIXES):
            errors.append(
                f"{name} is reserved: the runtime sets CUDA_* and NVIDIA_* to confine each "
                "rank to the GPUs it was given."
            )
        if "\x00" in value:
            errors.append(f"The value of {shown!r} contains a NUL character.")
        elif len(value) > MAX_ENV_VALUE:
            errors.append(f"The value of {shown!r} is longer than {MAX_ENV_VALUE:,} characters.")
        total += len(name) + len(value)
    if total > MAX_ENV_TOTAL and not errors:
        errors.append(f"Names and values total {total:,} characters; at most {MAX_ENV_TOTAL:,}.")
    return errors


def image_errors(image: str) -> list[str]:
    """Why this is not an OCI image reference (an empty one means the runtime's default)."""
    if not image:
        return []
    if len(image) > MAX_IMAGE:
        return [f"Must be at most {MAX_IMAGE} characters (got {len(image)})."]
    match = IMAGE_REFERENCE.fullmatch(image)
    if match is None:
        return [
            f"{image[:80]!r} is not an image reference such as "
            "registry.example.org/team/trainer:1.4 or name@sha256:<digest> "
            "(lower-case path, no spaces or shell characters)."
        ]
    if len(match.group("name")) > MAX_IMAGE_NAME:
        return [f"The repository name is longer than {MAX_IMAGE_NAME} characters."]
    return []


def image_admitted(image: str, prefix: str) -> bool:
    """Whether an allow-list entry `prefix` (a registry and repository path,
    such as registry.example.org/vision) admits `image`.

    Matched by path segment, never as raw text: the prefix must be the image's
    whole repository or end where one of its `/`-separated parts ends, so
    registry.example.org/vision admits registry.example.org/vision/trainer:1 but
    not registry.example.org/vision-exfil/trainer. A trailing `/` on the prefix
    means the same as none; the image's tag or digest is not part of the match."""
    repository = image.split("@", 1)[0]
    # A colon after the last slash starts a tag; one before it is a registry's port.
    if repository.rfind(":") > repository.rfind("/"):
        repository = repository[: repository.rfind(":")]
    root = prefix.rstrip("/")
    return bool(root) and (repository == root or repository.startswith(root + "/"))


def image_allowlist_errors(image: str, lists: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """Why `image` may not run under these allow-lists, each (team, prefixes)
    from the top of the team tree down; every list must admit it."""
    for team, prefixes in lists:
        if not any(image_admitted(image, prefix) for prefix in prefixes):
            return [
                f"Image {image} is not allowed for the jobs of team {team} and its "
                f"sub-teams; allowed are images under: {', '.join(prefixes) or 'none'}."
            ]
    return []


def text_errors(value: str, *, limit: int) -> list[str]:
    """Why a command or name cannot be stored and run."""
    if "\x00" in value:
        return ["Must not contain NUL characters."]
    if len(value) > limit:
        return [f"Must be at most {limit:,} characters (got {len(value):,})."]
    return []


def rank_range_errors(
    ranks: int, ranks_min: object, rank_sizes: Sequence[object] | None
) -> list[str]:
    """What is wrong with an elastic job's sizes: its smallest (`ranks_min`) and the
    only sizes it runs at (`rank_sizes`), against its largest, `ranks` (already
    checked). Empty for a fixed-size job (no `ranks_min`, no `rank_sizes`)."""
    if ranks_min is None:
        return ["Sizes need a min as well (the smallest)."] if rank_sizes else []
    if isinstance(ranks_min, bool) or not isinstance(ranks_min, int):
        return [f"min must be a whole number (got {ranks_min!r})."]
    if ranks_min < 1:
        return [f"min must be at least 1 (got {ranks_min})."]
    if ranks_min > ranks:
        return [f"min ({ranks_min}) must not be more than max ({ranks})."]
    if not rank_sizes:
        return []
    wrong = [size for size in rank_sizes if isinstance(size, bool) or not isinstance(size, int)]
    if wrong:
        return [f"Sizes must be whole numbers (got {', '.join(map(repr, wrong[:5]))})."]
    sizes = [size for size in rank_sizes if isinstance(size, int)]
    outside = sorted({size for size in sizes if not ranks_min <= size <= ranks})
    if outside:
        return [
            f"Sizes must lie from min {ranks_min} to max {ranks} "
            f"(got {', '.join(map(str, outside[:5]))})."
        ]
    if ranks_min not in sizes or ranks not in sizes:
        return [f"Sizes must include min {ranks_min} and max {ranks}."]
    return []


def ranks_words(
    running: int | None, ranks: int, ranks_min: int | None, sizes: Sequence[int]
) -> str:
    """A job's size as pages, the API and `qm` say it: "8 ranks", and for an elastic
    job the range it may run at, "4 ranks (elastic 2–8)" or "4 ranks (elastic 2, 4, 8)".
    `running` is the size of its latest attempt (None before the first: its largest)."""
    now = ranks if running is None else running
    words = f"{now} rank{'s' if now != 1 else ''}"
    if ranks_min is None:
        return words
    if sizes:
        return f"{words} (elastic {', '.join(map(str, sizes))})"
    return f"{words} (elastic {ranks_min}–{ranks})"

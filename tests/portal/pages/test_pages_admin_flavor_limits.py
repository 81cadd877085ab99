"""An admin sets a flavor's sandbox limits for its ranks on the admin site.

Sizes are typed as on the settings (`512M`, `32G`) and stored in bytes; a size that is
not one, or a limit below what a rank needs to start, is refused with a message saying
so, and the flavor is left as it was. Empty fields leave the site's limits.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from quotas.models import ResourceFlavor

pytestmark = pytest.mark.django_db


def change_flavor(world: Any, **fields: str) -> Any:
    admin = Client()
    admin.force_login(world.users["admin"])
    return admin.post(
        f"/admin/quotas/resourceflavor/{world.h100.pk}/change/",
        {"name": "h100-80gb", "description": "", **fields},
    )


def test_an_admin_sets_a_flavors_rank_limits_in_binary_units(world: Any) -> None:
    response = change_flavor(
        world, rank_pids_max="256", rank_memory_per_gpu="32G", rank_file_size_max="100G"
    )

    assert response.status_code == 302, response.content.decode()[:2000]
    flavor = ResourceFlavor.objects.get(pk=world.h100.pk)
    assert flavor.rank_pids_max == 256
    assert flavor.rank_memory_per_gpu == 32 << 30
    assert flavor.rank_file_size_max == 100 << 30
    admin = Client()
    admin.force_login(world.users["admin"])
    page = admin.get(f"/admin/quotas/resourceflavor/{world.h100.pk}/change/").content.decode()
    assert 'value="32 GiB"' in page
    listing = admin.get("/admin/quotas/resourceflavor/").content.decode()
    assert "256 processes, 32 GiB per GPU, files up to 100 GiB" in listing


def test_empty_limits_leave_the_sites(world: Any) -> None:
    world.h100.rank_pids_max = 64
    world.h100.save(update_fields=["rank_pids_max"])

    response = change_flavor(world, rank_pids_max="", rank_memory_per_gpu="", rank_file_size_max="")

    assert response.status_code == 302
    flavor = ResourceFlavor.objects.get(pk=world.h100.pk)
    assert (flavor.rank_pids_max, flavor.rank_memory_per_gpu, flavor.rank_file_size_max) == (
        None,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"rank_memory_per_gpu": "lots"},
            "&#x27;lots&#x27; is not a size: give a number with K, M, G or T",
        ),
        ({"rank_memory_per_gpu": "-1G"}, "is not a size"),
        ({"rank_memory_per_gpu": "1M"}, "1M is too small: a rank needs at least 64 MiB."),
        ({"rank_file_size_max": "4K"}, "4K is too small: a rank needs at least 1 MiB."),
        ({"rank_pids_max": "2"}, "Ensure this value is greater than or equal to 8."),
        ({"rank_pids_max": "many"}, "Enter a whole number."),
    ],
    ids=[
        "not a size",
        "negative",
        "memory too small",
        "file size too small",
        "pids too few",
        "pids not a number",
    ],
)
def test_a_bad_limit_is_refused_with_a_message_and_changes_nothing(
    world: Any, fields: dict[str, str], message: str
) -> None:
    before = list(ResourceFlavor.objects.values())

    response = change_flavor(world, **fields)

    assert response.status_code == 200
    assert message in response.content.decode()
    assert list(ResourceFlavor.objects.values()) == before

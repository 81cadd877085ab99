"""The embedded default's Celery broker: messages as files on local disk.

Kombu's filesystem transport creates a message file and only then writes it,
so a consumer can claim the file in between and read it empty; and it moves
claimed files through the system's temporary folder, which may be another
file system. This transport writes each message under a hidden name and
renames it into place, and claims a message by renaming it into a folder
beside the queue: both renames are atomic, so every message is read whole
by exactly one consumer.
"""

from __future__ import annotations

import os
import uuid
from queue import Empty
from time import monotonic
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

SCHEME = "qmdisk"


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        temporary = os.path.join(self.data_folder_out, f".{name}.tmp")
        with open(temporary, "wb") as handle:
            handle.write(str_to_bytes(dumps(payload)))
        os.rename(temporary, os.path.join(self.data_folder_out, name))

    def _get(self, queue: str) -> Any:
        wanted = f"{queue}.msg"
        for name in sorted(os.listdir(self.data_folder_in)):
            if name.startswith(".") or name.partition(".")[2] != wanted:
                continue
            claimed = os.path.join(self.processed_folder, name)
            try:
                os.rename(os.path.join(self.data_folder_in, name), claimed)
            except OSError:
                continue  # another consumer claimed it first
            with open(claimed, "rb") as handle:
                payload = handle.read()
            os.remove(claimed)
            return loads(bytes_to_str(payload))
        raise Empty()


class Transport(filesystem.Transport):
    Channel = Channel
    driver_type = SCHEME
    driver_name = SCHEME


TRANSPORT_ALIASES[SCHEME] = "portal.broker:Transport"

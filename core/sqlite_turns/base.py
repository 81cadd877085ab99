"""Django's SQLite backend, with its writers served in turn.

SQLite lets one transaction write at a time. The others wait in SQLite's busy
handler, which sleeps and retries with pauses that grow to 100 ms and serves
nobody in order: under a burst of job submissions, with the scheduling cycle and
the reconcile passes writing too, a few unlucky writers lost retry after retry and
one submission in twenty took a second or more.

Here each write transaction (BEGIN IMMEDIATE, which takes SQLite's write lock at
once) first takes an exclusive flock(2) on ``<database>.writers``. A waiting
writer blocks in the kernel and wakes as soon as the holder commits or rolls
back, and its BEGIN IMMEDIATE then finds the database free. Each connection opens
the file on its own, so two threads of one process wait for each other too. Reads
take nothing, nor does an in-memory database; a statement written outside a
transaction (autocommit) still waits in the busy handler, as before.

A writer that stalls holds the others: the control plane opens no transaction
around a runtime call or any other wait, and a web request or task that hangs is
ended by the web server's timeout or the task's time limit, which closes its
connection and with it the lock.

Django's backend has no hook for this and no library adds one, so the wrapper is
written here.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

from django.db.backends.sqlite3 import base


class DatabaseWrapper(base.DatabaseWrapper):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._turns: int | None = None
        self._turns_pid = 0
        self._holding_turn = False

    def _start_transaction_under_autocommit(self) -> None:
        self._take_turn()
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self._end_turn()
            raise

    def _commit(self) -> None:
        try:
            super()._commit()
        finally:
            self._end_turn()

    def _rollback(self) -> None:
        try:
            super()._rollback()
        finally:
            self._end_turn()

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            self._holding_turn = False
            if self._turns is not None:
                os.close(self._turns)  # releases the lock with the file
                self._turns = None

    def _take_turn(self) -> None:
        if self.is_in_memory_db():
            return  # no other process can write it
        if self._turns is not None and self._turns_pid != os.getpid():
            # Inherited across fork, the descriptor shares its lock with the parent's;
            # closing this copy leaves the parent's lock as it is.
            os.close(self._turns)
            self._turns = None
        if self._turns is None:
            path = f"{self.settings_dict['NAME']}.writers"
            self._turns = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._turns_pid = os.getpid()
        fcntl.flock(self._turns, fcntl.LOCK_EX)
        self._holding_turn = True

    def _end_turn(self) -> None:
        if self._holding_turn and self._turns is not None:
            self._holding_turn = False
            fcntl.flock(self._turns, fcntl.LOCK_UN)

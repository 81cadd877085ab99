"""How an empty limit is written, once for every page, form and API message:
an empty borrow limit is "no limit", an empty lend limit is "lend all"."""

from __future__ import annotations

NO_LIMIT = "no limit"
LEND_ALL = "lend all"


def borrow_limit_words(value: int | None) -> str:
    return NO_LIMIT if value is None else str(value)


def lend_limit_words(value: int | None) -> str:
    return LEND_ALL if value is None else str(value)

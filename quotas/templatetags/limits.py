"""Filters that write a quota's limits in the one wording of quotas.wording."""

from __future__ import annotations

from django import template

from quotas.wording import borrow_limit_words, lend_limit_words

register = template.Library()
register.filter("borrow_limit", borrow_limit_words)
register.filter("lend_limit", lend_limit_words)

"""A job's command as its submitter typed it, for pages to show.

`qm submit -- python -c "print('a b')"` receives the words after `--` with the
shell's quotes already taken off, and joins them with `shlex.join` so that
`sh -c` (how every runtime starts a rank) splits them back into exactly those
words. That join quotes for the machine: a word holding a single quote comes
out as `'print('"'"'a b'"'"')'`, which nobody typed and few can read. The
stored command is what runs and stays as it is; this module only words it
for reading, in quotes a person would have used, meaning the same to `sh`.
"""

from __future__ import annotations

import shlex

# Inside double quotes `sh` still expands these (and an interactive bash also `!`),
# so a word holding any of them keeps the machine's single quotes.
_ACTIVE_IN_DOUBLE_QUOTES = frozenset('"$`\\!')


def _readable_word(word: str) -> str:
    quoted = shlex.quote(word)
    if quoted == word or "'" not in word or _ACTIVE_IN_DOUBLE_QUOTES & set(word):
        return quoted
    return f'"{word}"'


def command_as_typed(command: str) -> str:
    """The command as typed: one joined by `shlex.join` (the CLI's words) is quoted
    again the way a person writes it; any other command (typed as one string in the
    job form or with `--command`) is shown exactly as stored, since that is how it
    was typed."""
    try:
        words = shlex.split(command)
    except ValueError:
        return command
    if not words or shlex.join(words) != command:
        return command
    return " ".join(_readable_word(word) for word in words)

"""How names from users, files and stores appear in messages and logs: control characters escaped.

A file name, object key, column or spec value may hold a newline, a carriage return or a terminal escape. Printed
as it is, `data\\nerror: forged.jsonl` would split an `error:` line in two and let whoever named the file write a
log line of their own (or erase one, with `\\r` or `ESC[2K`). Every name that reaches a message goes through
`quoted`, which leaves ordinary names (Korean ones included) exactly as they are and writes the others as an
escaped, quoted string, the way `repr` would.
"""

from __future__ import annotations

import unicodedata

_CONTROL_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
"""Control characters (C0, DEL, C1), format characters (bidirectional overrides that reorder what a terminal
shows, zero-width characters) and the Unicode line and paragraph separators."""


def control_character(text: str) -> str | None:
    """The first control, format or line-separator character of `text`, or None."""
    if text.isprintable():  # the common case, decided in C: no character of those categories (nor spaces but ' ')
        return None
    return next((c for c in text if unicodedata.category(c) in _CONTROL_CATEGORIES), None)


def quoted(name: object) -> str:
    """`name` as it may appear in a message: unchanged when it has no control character, else in quotes with each
    control character escaped (`\\n`, `\\r`, `\\x1b`, `\\u202e`)."""
    text = str(name)
    if control_character(text) is None:
        return text
    escaped = "".join(_escape(c) if unicodedata.category(c) in _CONTROL_CATEGORIES else c for c in text)
    return "'" + escaped.replace("'", "\\'") + "'"


def _escape(c: str) -> str:
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (
        f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"
    )

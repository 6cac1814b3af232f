"""Secrets kept out of what a run writes and prints: values and credential shapes masked in text, records, streams.

What counts as a secret is `spec.credentials`' rule; a stage's output, its records and the runner's own output
(`posttrain runs sync`) go through the same masks.
"""

from __future__ import annotations

import io
from typing import Any, TextIO

from spec import credentials

MASK = credentials.MASK


def secret_values() -> set[str]:
    """What must never be written out: values of secret-named environment variables (case-insensitive, word by
    word) and credentials found by shape inside any variable (`spec.credentials.secret_values`)."""
    return credentials.secret_values()


def mask_secrets(text: str, secrets: set[str] | None = None) -> str:
    """`text` with every secret value (default: `secret_values()`) and every credential-shaped span (URI userinfo,
    known key formats) replaced by MASK."""
    return credentials.scrub(text, secrets)


def mask_secrets_in(data: Any, secrets: set[str] | None = None) -> Any:
    """`data` (JSON-like: mappings, lists, strings) with `mask_secrets` applied to every string in it."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(data, str):
        return mask_secrets(data, secrets)
    if isinstance(data, dict):
        return {mask_secrets_in(k, secrets): mask_secrets_in(v, secrets) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [mask_secrets_in(v, secrets) for v in data]
    return data


class PassThrough(io.TextIOBase):
    """A text stream in front of another one: it answers isatty, fileno and encoding as the stream behind it."""

    def __init__(self, target: TextIO) -> None:
        self.target = target

    def isatty(self) -> bool:
        return self.target.isatty()

    def fileno(self) -> int:
        return self.target.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.target, "encoding", "utf-8")


class MaskingStream(PassThrough):
    """A text stream that masks secret values and credential shapes before passing the text on (line by line, so
    a secret is never split across two writes)."""

    def __init__(self, target: TextIO, secrets: set[str]) -> None:
        super().__init__(target)
        self.secrets = secrets
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            complete, _, self.pending = self.pending.rpartition("\n")
            self.target.write(mask_secrets(complete + "\n", self.secrets))
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.target.write(mask_secrets(self.pending, self.secrets))
            self.pending = ""
        self.target.flush()

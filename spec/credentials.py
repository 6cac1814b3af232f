"""Credentials: how the project recognises one, by name and by shape, and hides it from what it writes.

A credential is recognised three ways:
- by the name of the environment variable holding it (`looks_secret_name`): a name part such as TOKEN, SECRET,
  PASSWORD, KEY or WEBHOOK, compared case-insensitively part by part, so `wandb_key` and `AWS_ACCESS_KEY_ID` are
  secrets and `TOKENIZERS_PARALLELISM` is not;
- by its shape wherever it appears (`find_credentials`): the userinfo of a URI (`https://user:password@host`),
  and the formats of well-known keys (AWS access key ids, Hugging Face, GitHub, Slack and OpenAI-style tokens,
  JWTs such as Kubernetes and Argo tokens, `Bearer` headers, PEM private keys, `password=`-style query values);
- by value (`secret_values`): every value of a secret-named environment variable, and every credential found by
  shape inside any environment variable (the password of a `DATABASE_URL` or `MLFLOW_TRACKING_URI`).

`scrub` replaces all of them with MASK. The stages pass everything they print and write through it (logs,
stage.json, reports, tracking); the spec refuses credential-shaped values outright (`spec.loading`), naming
the Secret-based way to pass them. Control plane: no imports beyond the standard library.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MASK = "***"

MIN_SECRET_LENGTH = 6
"""Shorter values of secret-named variables are not masked: replacing them would garble ordinary text."""

# Words that make an environment variable name a secret, matched against each part of the name ...
_SECRET_WORDS = frozenset(
    {
        "token",
        "secret",
        "secrets",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "credential",
        "credentials",
        "webhook",
        "key",
        "keys",
        "apikey",
        "accesskey",
        "secretkey",
        "privatekey",
        "pat",
        "dsn",
    }
)
# ... and the endings of a part that glues words together (`hftoken`, `mlflowpassword`).
_SECRET_SUFFIXES = ("token", "secret", "password", "passwd", "apikey", "accesskey", "secretkey", "privatekey")

URI_USERINFO = "credentials in a URI (user:password@)"

_NAME_PARTS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def name_parts(name: str) -> list[str]:
    """The words of an identifier, lower-cased: `AWS_ACCESS_KEY_ID` → aws access key id, `hfToken` → hf token."""
    return [part.lower() for chunk in re.split(r"[^A-Za-z0-9]+", name) for part in _NAME_PARTS.findall(chunk)]


_NOT_SECRETS = frozenset({"pwd", "oldpwd"})
"""The shell's working directories, whose names read like the abbreviation of 'password'."""


def looks_secret_name(name: str) -> bool:
    """Whether a variable or field named `name` holds a secret (case-insensitive, word by word)."""
    if name.lower() in _NOT_SECRETS:
        return False
    return any(part in _SECRET_WORDS or part.endswith(_SECRET_SUFFIXES) for part in name_parts(name))


@dataclass(frozen=True)
class _Shape:
    """A credential format: what it is called, its pattern, and the group that holds the secret part."""

    what: str
    pattern: re.Pattern[str]
    group: int = 0


_SHAPES: tuple[_Shape, ...] = (
    # Before the token formats: a URI's userinfo hides whatever it holds, token or password.
    _Shape(URI_USERINFO, re.compile(r"\b[a-z][a-z0-9+.-]*://([^\s/?#@]+)@", re.I), 1),
    _Shape(
        "a PEM private key",
        re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)"),
    ),
    _Shape("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b")),
    _Shape("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")),
    _Shape("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{40,})\b")),
    _Shape("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}")),
    _Shape("a Slack webhook URL", re.compile(r"hooks\.slack\.com/(?:services|workflows)/[A-Za-z0-9_/-]+")),
    _Shape("an API key (sk-...)", re.compile(r"\b(?:sk|pk)-(?:lf-|proj-|ant-)?[A-Za-z0-9_-]{20,}")),
    _Shape("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),
    _Shape("a JSON Web Token", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")),
    # A token has a digit or a base64 symbol somewhere; prose after the word "Basic" has neither.
    _Shape(
        "a bearer token",
        re.compile(r"\b(?:Bearer|Basic)\s+((?=[A-Za-z0-9._~+/-]*[0-9+/=])[A-Za-z0-9._~+/-]{12,}=*)"),
        1,
    ),
    _Shape(
        "a password or token in a query string",
        re.compile(
            r"[?&;](?:password|passwd|pwd|token|access_token|api_key|apikey|secret|client_secret|sig|signature"
            r"|x-amz-signature|x-amz-credential|x-goog-signature)=([^&\s#\"']+)",
            re.I,
        ),
        1,
    ),
)


@dataclass(frozen=True)
class Credential:
    """A credential found in a text: what kind it is and where its secret part lies."""

    what: str
    start: int
    end: int


def find_credentials(text: str) -> list[Credential]:
    """The credential-shaped spans of `text`, by position (overlapping finds of later shapes dropped)."""
    found: list[Credential] = []
    for shape in _SHAPES:
        for match in shape.pattern.finditer(text):
            start, end = match.span(shape.group)
            if start == end or any(c.start < end and start < c.end for c in found):
                continue
            found.append(Credential(shape.what, start, end))
    return sorted(found, key=lambda c: c.start)


def uri_userinfo(value: str) -> str | None:
    """The userinfo of a URI-shaped value (`https://user:pw@host` → `user:pw`), else None."""
    match = re.match(r"^[a-z][a-z0-9+.-]*://([^\s/?#@]+)@", value.strip(), re.I)
    return match.group(1) if match else None


def secret_values(environ: Mapping[str, str] | None = None) -> set[str]:
    """What must never be written out: the values of secret-named variables of `environ` (the process's
    environment by default) of at least MIN_SECRET_LENGTH characters, and every credential found by shape inside
    any variable's value (e.g. the password in `MLFLOW_TRACKING_URI=https://user:pw@host`)."""
    env = os.environ if environ is None else environ
    values: set[str] = set()
    for name, value in env.items():
        if looks_secret_name(name) and len(value) >= MIN_SECRET_LENGTH:
            values.add(value)
        for credential in find_credentials(value):
            part = value[credential.start : credential.end]
            if credential.what == URI_USERINFO:  # the password; a user name alone is no secret
                part = part.partition(":")[2]
            if len(part) >= MIN_SECRET_LENGTH:
                values.add(part)
    return values


def scrub(text: str, secrets: Iterable[str] | None = None) -> str:
    """`text` with every secret value (default: `secret_values()`) and every credential-shaped span replaced by
    MASK. Secret values go first, longest first, so a secret inside another goes too."""
    for value in sorted(secret_values() if secrets is None else set(secrets), key=len, reverse=True):
        if value and value in text:
            text = text.replace(value, MASK)
    for credential in reversed(find_credentials(text)):
        if text[credential.start : credential.end] != MASK:
            text = text[: credential.start] + MASK + text[credential.end :]
    return text

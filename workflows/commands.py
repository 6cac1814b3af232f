"""The conventions every command of the CLI keeps: -V/--version; "did you mean" for an unknown command.

Imported by `workflows.cli` and by each subcommand's module; it imports none of them.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def unknown_command(word: str, known: Iterable[str]) -> str:
    """The message for a command that does not exist: the closest known one, else them all."""
    import difflib

    known = list(known)
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    if close:
        return f"unknown command {word!r}; did you mean {close[0]!r}?"
    return f"unknown command {word!r}; commands: {', '.join(known)}"


def version() -> str:
    """`posttrain --version`: the installed package's version and the source commit, when known."""
    from run.version import git_sha, package_version

    sha = git_sha()
    return f"posttrain {package_version()}" + (f" (commit {sha[:12]})" if sha else "")


class _VersionAction(argparse.Action):
    """-V/--version: print `version()` and exit; the commit is looked up only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="Print the version and exit.")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(version())
        parser.exit()


def add_version_option(parser: argparse.ArgumentParser) -> None:
    """-V/--version on a subcommand's parser (`python -m workflows.submit --version`)."""
    parser.add_argument("-V", "--version", action=_VersionAction)

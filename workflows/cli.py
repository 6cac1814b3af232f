"""The `posttrain` command: one entry point whose subcommands delegate to the `python -m workflows.*` modules.

    posttrain submit korean-llm --render out/       = python -m workflows.submit korean-llm --render out/
    posttrain local korean-llm                      = python -m workflows.submit korean-llm --local
    posttrain register | runs | preflight | import  = python -m workflows.register | runs | preflight | import

Each subcommand's module is imported only when it runs, so `posttrain --help` stays fast (and nothing here imports
torch or transformers). The help texts shared with `python -m workflows.submit --help` (shipped pipelines,
environment variables, exit codes) live in workflows/help_text.py.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from workflows.commands import unknown_command, version
from workflows.help_text import epilog

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("workflows.submit", "compile a pipeline; render, print or submit it to Argo (or run it --local)"),
    "local": ("workflows.submit", "run a pipeline's DAG on this machine (= submit --local)"),
    "register": ("workflows.register", "create or update a pipeline's WorkflowTemplate and CronWorkflow"),
    "runs": ("workflows.runs", "list, watch, stop, retry and prune runs; logs of a stage"),
    "preflight": ("workflows.preflight", "check that the cluster has what a pipeline needs"),
    "import": ("workflows.import", "turn a LLaMA-Factory or axolotl recipe into a pipeline file"),
}
"""Subcommand → (the module it runs, one line of help)."""


def usage() -> str:
    """`posttrain --help`."""
    width = max(len(name) for name in SUBCOMMANDS)
    commands = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items())
    return (
        "usage: posttrain COMMAND [ARGS...]\n       posttrain --version\n\n"
        "LLM post-training pipelines on Kubernetes (Argo Workflows + Kubeflow), or on this machine.\n\n"
        f"commands:\n{commands}\n\n"
        "`posttrain COMMAND --help` shows a command's options.\n\n" + epilog()
    )


def _entry(module: str) -> Callable[[list[str] | None], int]:
    """The `main(argv)` of a subcommand's module, imported now."""
    import importlib

    return importlib.import_module(module).main


def main(argv: list[str] | None = None) -> int:
    """Run `posttrain COMMAND ARGS...`; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] in ("-V", "--version", "version"):
        print(version())
        return 0
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        print(f"error: {unknown_command(command, SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module = SUBCOMMANDS[command][0]
    if command == "local":
        rest = [*rest, "--local"] if not {"-h", "--help"} & set(rest) else rest
    if module in ("workflows.submit", "workflows.register"):
        from workflows.submit import run_cli  # CliError, SpecError, ArgoError and Ctrl-C as messages

        run_cli(_entry(module), rest)  # exits
    try:
        return _entry(module)(rest)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The console script."""
    sys.exit(main())


if __name__ == "__main__":
    run()

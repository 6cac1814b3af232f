"""`python -m workflows.submit`: compile a pipeline and render it, print it, submit it to Argo, or run it locally.

    python -m workflows.submit korean-llm --render out/      # write workflowtemplate.yaml, workflow.yaml, ...
    python -m workflows.submit korean-llm --dry-run          # print the Workflow, touch nothing
    python -m workflows.submit korean-llm --watch            # ensure the template, submit, follow the run
    python -m workflows.submit korean-llm --local            # the same DAG on this machine (profile 'local')

Expected failures (unknown pipeline, invalid spec or --set, server unreachable, 401/403, conflicts) print one
message that says what to fix and exit non-zero; the Argo client, rich and the runner are imported only when used.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import yaml

from workflows.loading import LoadedPipeline, SpecError, load_pipeline

if TYPE_CHECKING:
    from workflows.argo import ArgoClient
    from workflows.compile import CompiledPipeline

EXIT_FAILED = 1
"""The server refused or failed, or the watched workflow did not succeed."""
EXIT_USAGE = 2
"""The pipeline, its spec, a --set or an option is wrong."""
EXIT_INTERRUPTED = 130

LOCAL_PROFILE = "local"
"""The profile --local uses when no --profile is given and the pipeline has one."""

DOCUMENT_ORDER = ("workflowtemplate.yaml", "cronworkflow.yaml", "workflow.yaml")


class CliError(Exception):
    """An expected failure: the message is printed as is and the command exits with `code`."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- shared by submit and register


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """The pipeline, --set and --profile options."""
    parser.add_argument("pipeline", metavar="NAME|PATH", help="A pipeline of workflows/pipelines/ or a YAML file.")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="Override a spec field, e.g. --set stages.sft.training.learning_rate=1e-4 (repeatable).",
    )
    parser.add_argument("--profile", help="Merge the named profile of the spec before the --set overrides.")


def load(pipeline: str, profile: str | None, overrides: list[str]) -> LoadedPipeline:
    """Load and validate the pipeline; a SpecError becomes a usage error."""
    try:
        return load_pipeline(pipeline, profile, overrides)
    except SpecError as exc:
        lines = str(exc).splitlines()
        if len(lines) > 1:
            lines = ["the pipeline spec is not valid:", *(f"  {line}" for line in lines)]
        message = "\n".join(lines)
        raise CliError(message, EXIT_USAGE) from None


def compile_loaded(loaded: LoadedPipeline) -> CompiledPipeline:
    """The CompiledPipeline of a loaded spec."""
    from workflows.compile import compile_pipeline

    try:
        return compile_pipeline(loaded.spec)
    except (SpecError, ValueError) as exc:
        raise CliError(f"cannot compile {loaded.source}: {exc}", EXIT_USAGE) from None


def argo_client(loaded: LoadedPipeline) -> ArgoClient:
    """An ArgoClient configured from ARGO_* variables, in the spec's namespace unless ARGO_NAMESPACE is set."""
    from workflows.argo import ArgoClient, ArgoError

    try:
        return ArgoClient.from_env(loaded.spec.cluster.namespace)
    except ArgoError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None) -> NoReturn:
    """Run `main(argv)`, turning CliError, SpecError, ArgoError and Ctrl-C into a message and an exit code."""
    try:
        code = main(argv)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = exc.code
    except SpecError as exc:  # e.g. from the local runner re-reading a spec
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except Exception as exc:
        # An ArgoError can only come from workflows.argo once imported; importing it here would slow --local.
        argo = sys.modules.get("workflows.argo")
        if argo is None or not isinstance(exc, argo.ArgoError):
            raise
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    sys.exit(code)


# --------------------------------------------------------------------------- YAML


_SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
"""libyaml's emitter when PyYAML was built with it (over ten times faster), else the pure-Python one."""


class _BlockStrDumper(_SafeDumper):
    """A safe dumper that writes multi-line strings as literal blocks, so scripts stay readable."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockStrDumper.add_representer(str, _str_representer)


def to_yaml(document: dict[str, Any]) -> str:
    """A resource as YAML, keys in their natural order, Unicode kept."""
    return yaml.dump(document, Dumper=_BlockStrDumper, sort_keys=False, allow_unicode=True, width=120)


def render(documents: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write each document to out_dir/<file>; remove a cronworkflow.yaml left by an earlier, scheduled render."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for file_name in sorted(documents, key=lambda f: (*DOCUMENT_ORDER, f).index(f)):
            path = out_dir / file_name
            path.write_text(to_yaml(documents[file_name]), encoding="utf-8")
            written.append(path)
        stale = out_dir / "cronworkflow.yaml"
        if "cronworkflow.yaml" not in documents and stale.is_file():
            stale.unlink()
            print(f"removed {stale} (the pipeline has no schedule now)")
    except OSError as exc:
        raise CliError(f"cannot write to --render {out_dir}: {exc.strerror or exc}") from None
    return written


# --------------------------------------------------------------------------- submit


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m workflows.submit",
        description="Compile a post-training pipeline to Argo Workflows and render, submit or run it.",
    )
    add_pipeline_arguments(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--render", type=Path, metavar="DIR", help="Write the manifests as YAML into DIR; submit nothing."
    )
    mode.add_argument("--dry-run", action="store_true", help="Print the Workflow YAML; submit nothing.")
    mode.add_argument("--local", action="store_true", help="Run the DAG on this machine instead of Argo.")
    p.add_argument("--watch", action="store_true", help="After submitting, follow the run until it ends.")
    p.add_argument(
        "--watch-interval", type=float, default=5.0, metavar="SECONDS", help="Seconds between polls (--watch)."
    )
    p.add_argument(
        "--skip-preflight",
        action="store_true",
        help="Submit without first checking the cluster (CRDs, volumes, secrets, GPU nodes, Argo version).",
    )
    p.add_argument("--run-dir", type=Path, metavar="DIR", help="Run directory for --local.")
    p.add_argument("--force", action="store_true", help="With --local: start over in an existing run directory.")
    return p


def _load_for_local(args: argparse.Namespace) -> LoadedPipeline:
    """The pipeline for --local: with --profile if given, else with the 'local' profile when the spec has one."""
    if args.profile is not None:
        return load(args.pipeline, args.profile, args.overrides)
    plain = load(args.pipeline, None, args.overrides)
    if LOCAL_PROFILE in plain.spec.profiles:
        return load(args.pipeline, LOCAL_PROFILE, args.overrides)
    return plain


def preflight(loaded: LoadedPipeline) -> None:
    """Check the cluster before anything is created; a blocking failure stops the submission with the fixes."""
    from rich.console import Console

    from workflows.preflight import run_preflight

    report = run_preflight(loaded.spec)
    if not report.ok:
        Console(stderr=True).print(report.render())
        raise CliError(f"preflight: {report.verdict()}. Fix what the table says, or pass --skip-preflight.")
    print(f"preflight: {report.verdict()}")


def _submit(args: argparse.Namespace, loaded: LoadedPipeline, compiled: CompiledPipeline) -> int:
    client = argo_client(loaded)  # a missing ARGO_SERVER is reported before any cluster check
    if not args.skip_preflight:
        preflight(loaded)
    with client:
        applied = client.ensure_workflow_template(compiled.template)
        print(applied)
        name = client.submit_workflow(compiled.workflow)
        print(f"submitted Workflow {client.namespace}/{name}")
        print(client.ui_url(name))
        if not args.watch:
            return 0
        from workflows.watch import watch

        return watch(client, name, interval=args.watch_interval)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and do what it asks; returns the exit code."""
    p = parser()
    args = p.parse_args(argv)
    if args.watch and (args.render or args.dry_run or args.local):
        p.error("--watch follows a submitted run; it cannot be combined with --render, --dry-run or --local")
    if args.skip_preflight and (args.render or args.dry_run or args.local):
        p.error("--skip-preflight goes with a submission to the Argo server")
    if (args.run_dir is not None or args.force) and not args.local:
        p.error("--run-dir and --force go with --local")
    if args.watch_interval < 0:
        p.error("--watch-interval must be zero or more seconds")

    if args.local:
        loaded = _load_for_local(args)
        from workflows.local import run_local

        return run_local(loaded, args.run_dir, args.force)

    loaded = load(args.pipeline, args.profile, args.overrides)
    compiled = compile_loaded(loaded)
    if args.render is not None:
        written = render(compiled.documents(), args.render)
        for path in written:
            print(f"wrote {path}")
        to_apply = " ".join(f"-f {path}" for path in written if path.name != "workflow.yaml")
        print(f"next: kubectl apply {to_apply} && argo submit {args.render / 'workflow.yaml'}")
        return 0
    if args.dry_run:
        sys.stdout.write(to_yaml(compiled.documents()["workflow.yaml"]))
        return 0
    return _submit(args, loaded, compiled)


if __name__ == "__main__":
    run_cli(main, None)

"""`python -m workflows.submit`: compile a pipeline and render it, print it, submit it to Argo, or run it locally.

    python -m workflows.submit korean-llm --render out/      # write workflowtemplate.yaml, workflow.yaml, ...
    python -m workflows.submit korean-llm --dry-run          # print the Workflow, touch nothing
    python -m workflows.submit korean-llm --watch            # ensure the template, submit, follow the run
    python -m workflows.submit korean-llm --set stages.sft.training.learning_rate=1e-4   # one run, one change
    python -m workflows.submit korean-llm --local            # the same DAG on this machine (profile 'local')
    python -m workflows.submit qwen-multi --variant qwen-7b  # a pipeline with variants: train only this one

Submitting ensures the shared WorkflowTemplate, compiled from the pipeline file and --profile only (the schedule
and every later run use it), then creates a Workflow that references it. The --set values are that run's alone:
they travel as the Workflow's `overrides` argument, one per line after the parameter's default, where the Argo UI
shows them and "Resubmit" can edit them, and the prepare step applies them in the cluster exactly as form input.
They are checked here first with the prepare step's own function, so a bad value fails on this machine. A --set
of a field the form may not set (compiled into the template's manifests, or deciding what code runs or where
credentials go) is refused: it is part of the shared template, changed in the pipeline file or a profile and
registered (`python -m workflows.register`). `--set stages.<stage>.enabled=false` sets the form's run-<stage>.

With --profile P the template (and a schedule registered with it) is named `<pipeline>-P`, so a profile never
replaces the plain template; runs keep the generateName `<pipeline>-`.

--render and --dry-run write standalone documents and accept any --set: the values are compiled into the
template (and the schedule), and workflow.yaml references that template with the form's defaults, so the three
files agree with each other. Applied with `kubectl apply --server-side` (a client-side apply stores the whole object
in an annotation, which fails over 256 KiB), a template rendered with --set replaces the shared one of that name,
which the schedule runs; over a template `workflows.register` wrote, add --force-conflicts. --dry-run prints that
workflow.yaml, not the Workflow a submission sends.

Expected failures (unknown pipeline, invalid spec or --set, server unreachable, 401/403, conflicts) print one
message that says what to fix and exit non-zero; the Argo client, rich and the runner are imported only when used.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import yaml

from run.exits import EXIT_GATE_FAILED
from spec.document import LoadedPipeline, SpecError
from spec.loading import load_pipeline, parse_override

if TYPE_CHECKING:
    from spec.pipeline import PipelineSpec
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


def add_pipeline_arguments(parser: argparse.ArgumentParser, set_help: str) -> None:
    """The pipeline, --set and --profile options."""
    parser.add_argument("pipeline", metavar="NAME|PATH", help="A pipeline of workflows/pipelines/ or a YAML file.")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help=f"Override a spec field, e.g. --set stages.sft.training.learning_rate=1e-4 (repeatable). {set_help}",
    )
    parser.add_argument(
        "--profile",
        help="Merge the named profile of the spec before the --set overrides; its template is named NAME-PROFILE.",
    )


def usage_error(exc: SpecError) -> CliError:
    """A SpecError as a usage error; several problems are listed under one heading."""
    lines = str(exc).splitlines()
    if len(lines) > 1:
        lines = ["the pipeline spec is not valid:", *(f"  {line}" for line in lines)]
    return CliError("\n".join(lines), EXIT_USAGE)


def load(pipeline: str, profile: str | None, overrides: list[str]) -> LoadedPipeline:
    """Load and validate the pipeline; a SpecError becomes a usage error."""
    try:
        return load_pipeline(pipeline, profile, overrides)
    except SpecError as exc:
        raise usage_error(exc) from None


def check_lm_eval_tasks(spec: PipelineSpec, source: str) -> None:
    """A usage error for each lm-eval task that the installed harness (and the include path, where it can be read
    here) does not define. Skipped where lm-eval is not installed: prepare checks the same in the pod."""
    evaluate = spec.stages.evaluate
    if not (evaluate.enabled and evaluate.lm_eval_tasks) or importlib.util.find_spec("lm_eval") is None:
        return
    from spec.lm_eval_tasks import unknown_tasks

    problems = unknown_tasks(spec)
    if problems:
        raise usage_error(SpecError("\n".join(f"{source}: {problem}" for problem in problems)))


def compile_loaded(loaded: LoadedPipeline, parameters: dict[str, str] | None = None) -> CompiledPipeline:
    """The CompiledPipeline of a loaded spec, its template named after the pipeline and profile (`parameters`:
    the Workflow's argument values, default the form's)."""
    from workflows.compile import compile_pipeline

    try:
        return compile_pipeline(loaded.spec, parameters, profile=loaded.profile)
    except (SpecError, ValueError) as exc:
        raise CliError(f"cannot compile {loaded.source}: {exc}", EXIT_USAGE) from None


def argo_client(loaded: LoadedPipeline) -> ArgoClient:
    """An ArgoClient configured from ARGO_* variables, in the spec's namespace; an ARGO_NAMESPACE that names
    another one is a usage error (the jobs the workflow creates would land in the spec's)."""
    from workflows.argo import ArgoClient, ArgoConfig, ArgoError

    try:
        config = ArgoConfig.from_env(loaded.spec.cluster.namespace)
        config.require_namespace(loaded.spec.cluster.namespace)
    except ArgoError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    return ArgoClient(config)


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
    from workflows.commands import add_version_option
    from workflows.help_text import epilog

    p = argparse.ArgumentParser(
        prog="python -m workflows.submit",
        description="Compile a post-training pipeline to Argo Workflows and render, submit or run it.",
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_version_option(p)
    add_pipeline_arguments(
        p,
        "Submitted, it changes this run only, through the form's overrides; --render and --dry-run compile it in.",
    )
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
    p.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=[],
        metavar="NAME",
        help="A pipeline with variants: run this one (repeatable; default all). Submitted or rendered, the others' "
        "run-<variant> switches are off; with --local, the others are not run.",
    )
    p.add_argument("--run-dir", type=Path, metavar="DIR", help="Run directory for --local.")
    p.add_argument("--force", action="store_true", help="With --local: start over in an existing run directory.")
    p.add_argument(
        "--fail-on-gate",
        action="store_true",
        help=f"With --local: exit with {EXIT_GATE_FAILED} when every stage ran but the gate failed (deploy skipped); "
        "without it that run exits 0, as the cluster's workflow succeeds.",
    )
    return p


def _load_for_local(args: argparse.Namespace) -> LoadedPipeline:
    """The pipeline for --local: with --profile if given, else with the 'local' profile when the spec has one."""
    if args.profile is not None:
        return load(args.pipeline, args.profile, args.overrides)
    plain = load(args.pipeline, None, args.overrides)
    if LOCAL_PROFILE in plain.spec.profiles:
        return load(args.pipeline, LOCAL_PROFILE, args.overrides)
    return plain


def local_command(args: argparse.Namespace) -> list[str]:
    """The --local command line as the user gave it (the pipeline as typed, name or path, with its --profile and
    --set options), without --variant, --run-dir and --force: the runner adds those to its resume hint."""
    argv = ["python", "-m", "workflows.submit", args.pipeline, "--local"]
    if args.profile is not None:
        argv += ["--profile", args.profile]
    return argv + [f"--set={override}" for override in args.overrides]


def preflight(spec: PipelineSpec) -> None:
    """Check the cluster for the run's spec before anything is created; a blocking failure stops the submission
    with the fixes."""
    from rich.console import Console

    from workflows.preflight import run_preflight

    report = run_preflight(spec)
    if not report.ok:
        report.show(Console(stderr=True))
        raise CliError(f"preflight: {report.verdict()}. Fix what the lines above say, or pass --skip-preflight.")
    print(f"preflight: {report.verdict()}")


def register_command(pipeline: str, profile: str | None) -> str:
    """The `workflows.register` command line that registers the shared template of a pipeline and profile."""
    argv = ["python", "-m", "workflows.register", pipeline]
    if profile is not None:
        argv += ["--profile", profile]
    return shlex.join(argv)


def _template_field_error(args: argparse.Namespace, template: str, keys: list[str], fixed: tuple[str, ...]) -> CliError:
    """Why a --set of `keys` cannot change one run: it sets (or replaces a section holding) `fixed`, a field of
    the shared template."""
    from spec.form import PIPELINE_FILE_ONLY

    field, fixed_name = ".".join(keys), ".".join(fixed)
    reason = PIPELINE_FILE_ONLY.get(fixed, "compiled into its manifests")
    part_of = f"part of the shared WorkflowTemplate {template} ({reason}) and cannot change per run"
    fixes = (
        f"change it in the pipeline file or a profile and run `{register_command(args.pipeline, args.profile)}`, "
        "or use --render DIR for standalone YAML"
    )
    if len(fixed) > len(keys):  # a mapping value would replace the whole section, the fixed field with it
        return CliError(
            f"--set {field}: it would replace {fixed_name}, which is {part_of}: set the fields below {field} one "
            f"per --set, or {fixes}",
            EXIT_USAGE,
        )
    subject = "it" if fixed == tuple(keys) else fixed_name
    return CliError(f"--set {field}: {subject} is {part_of}: {fixes}", EXIT_USAGE)


def run_arguments(
    args: argparse.Namespace, loaded: LoadedPipeline, template: str
) -> tuple[dict[str, str], list[PipelineSpec]]:
    """The Workflow's argument values that carry the --set overrides of `args` to a run of `template` (compiled
    from `loaded`), and the specs prepare will resolve from them (one per variant it runs; one without variants).

    Each --set is a line of the `overrides` argument, after its default; `stages.<stage>.enabled` is the stage's
    run-<stage> switch instead, as in the form. A field of the shared template is refused. The values are then
    resolved with the prepare step's own function, so what passes here passes there."""
    from spec import form as spec_form
    from workflows import parameters as params

    defaults = {p.name: p.default for p in params.ui_parameters(loaded.spec)}
    values: dict[str, str] = {}
    lines: list[str] = []
    for expr in args.overrides:
        # The form reads one override per line and skips comment lines: a --set has to be exactly one line.
        if expr.splitlines() != [expr] or expr.lstrip().startswith("#"):
            raise CliError(f"--set {expr!r}: expected one path.to.field=value on a single line", EXIT_USAGE)
        keys, value = parse_override(expr)
        switch = f"run-{keys[1]}" if len(keys) == 3 and keys[0] == "stages" and keys[2] == "enabled" else None
        if switch in defaults:
            if not isinstance(value, bool):
                raise CliError(f"--set {expr}: expected true or false", EXIT_USAGE)
            values[switch] = str(value).lower()
        elif (fixed := spec_form.fixed_field(keys)) is not None:
            raise _template_field_error(args, template, keys, fixed)
        else:
            lines.append(expr.strip())
    default_lines = defaults[spec_form.OVERRIDES].splitlines()
    if lines:
        values[spec_form.OVERRIDES] = "\n".join([*default_lines, *lines])

    def origin(number: int) -> str:
        index = number - len(default_lines) - 1
        return f"--set {lines[index]}" if index >= 0 else spec_form.form_line(number)

    values.update(variant_switches(args, loaded))
    if loaded.spec.variants:
        return values, _variant_run_specs(loaded, values, origin)
    try:
        spec = spec_form.resolve_parameters(params.embedded_document(loaded.spec), values, origin)
    except SpecError as exc:
        raise usage_error(exc) from None
    return values, [spec]


def selected_variants(args: argparse.Namespace, loaded: LoadedPipeline) -> dict[str, LoadedPipeline]:
    """The variants --variant picks (all when none is named); a usage error for one the pipeline lacks, or for
    --variant given to a pipeline without variants."""
    from spec.variants import select

    if args.variants and not loaded.spec.variants:
        raise CliError(f"--variant: {loaded.source} has no variants", EXIT_USAGE)
    try:
        return select(loaded, args.variants)
    except SpecError as exc:
        raise usage_error(exc) from None


def variant_switches(args: argparse.Namespace, loaded: LoadedPipeline) -> dict[str, str]:
    """The form's run-<variant> values for the variants --variant leaves out (none when it names none)."""
    chosen = selected_variants(args, loaded)
    return {f"run-{v.name}": "false" for v in loaded.spec.variants if v.name not in chosen}


def _variant_run_specs(loaded: LoadedPipeline, values: dict[str, str], origin: Callable[[int], str]) -> list[Any]:
    """The spec each switched-on variant's prepare will resolve from the form's `values`."""
    from spec import form as spec_form
    from spec.variants import variant_specs
    from workflows import parameters as params

    specs = []
    for name, vspec in variant_specs(loaded.spec).items():
        if values.get(f"run-{name}", "true") != "false":
            own = params.variant_values(loaded.spec, name, values)
            try:
                specs.append(spec_form.resolve_parameters(params.embedded_document(vspec), own, origin))
            except SpecError as exc:
                raise usage_error(SpecError(f"variant {name}: {exc}")) from None
    return specs


def check_data(specs: list[PipelineSpec], visible_only: bool = False) -> None:
    """A usage error, one `error:` line per problem, when the data of a run of `specs` is missing, unreadable, or
    does not match its format, column mapping or encoding on its first rows (workflows/data_check.py); before
    anything is written. `visible_only`: data this machine cannot see is the cluster's (--dry-run)."""
    from workflows.data_check import data_problems

    errors, warnings = data_problems(specs, visible_only)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    if errors:  # printed by run_cli as "error: " + the message: each line keeps its own "error: "
        raise CliError("\n".join(errors).removeprefix("error: "), EXIT_USAGE)


def prepared_before(run_dir: Path | None, force: bool) -> bool:
    """Whether --local resumes a run directory whose prepare succeeded (it will not read the data again, so the
    data is not checked: a resume must not fail on a file moved since)."""
    if run_dir is None or force:
        return False
    try:
        record = json.loads((run_dir / "prepare" / "stage.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("status") == "succeeded"


def warn_about_plan(loaded: LoadedPipeline) -> None:
    """The plan's warnings (workflows/plan.py), on stderr: what --local prints before it runs, said before a cluster
    run too (stdout may be the YAML of --dry-run)."""
    from workflows.plan import plan_warnings

    for line in plan_warnings(loaded):
        print(f"warning: {line}", file=sys.stderr)


def _submit(args: argparse.Namespace) -> int:
    from workflows.argo import StaleObject
    from workflows.compile import submitted_workflow

    # The shared template comes from the pipeline file and profile alone; the --set values are this run's.
    loaded = load(args.pipeline, args.profile, [])
    template = compile_loaded(loaded).template
    values, run_specs = run_arguments(args, loaded, template.name)
    for run_spec in run_specs:
        check_lm_eval_tasks(run_spec, loaded.source)
    warn_about_plan(load(args.pipeline, args.profile, args.overrides))
    workflow = submitted_workflow(loaded.spec, values, template.name)

    client = argo_client(loaded)  # a missing ARGO_SERVER is reported before any cluster check
    if not args.skip_preflight:
        for run_spec in run_specs:
            preflight(run_spec)
    with client:
        try:
            applied = client.ensure_workflow_template(template)
        except StaleObject as exc:
            # Submitters may only read templates: registering is the registrar's job.
            command = register_command(args.pipeline, args.profile)
            raise CliError(
                f"{exc.summary}: someone with the registrar role should run `{command}`, then submit again"
            ) from None
        print(applied)
        name = client.submit_workflow(workflow)
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
    if (args.run_dir is not None or args.force or args.fail_on_gate) and not args.local:
        p.error("--run-dir, --force and --fail-on-gate go with --local")
    if args.watch_interval < 0:
        p.error("--watch-interval must be zero or more seconds")

    if args.local:
        loaded = _load_for_local(args)
        if not loaded.spec.variants and not args.variants:
            from workflows.local import run_local

            if not prepared_before(args.run_dir, args.force):
                check_data([loaded.spec])  # before the run directory is made

            return run_local(
                loaded, args.run_dir, args.force, resume=local_command(args), fail_on_gate=args.fail_on_gate
            )
        chosen = selected_variants(args, loaded)
        if args.run_dir is not None and len(chosen) > 1:
            p.error(f"--run-dir holds one run: pick one variant with --variant ({', '.join(chosen)})")
        from workflows.local import run_local_variants

        if not prepared_before(args.run_dir, args.force):
            check_data([variant.spec for variant in chosen.values()])  # every variant's, before any runs

        return run_local_variants(
            chosen, args.run_dir, args.force, resume=local_command(args), fail_on_gate=args.fail_on_gate
        )

    if args.render is None and not args.dry_run:
        return _submit(args)
    # Standalone documents: every --set is compiled in (see the module docstring).
    loaded = load(args.pipeline, args.profile, args.overrides)
    for run_spec in [*selected_variants(args, loaded).values()] or [loaded]:
        check_lm_eval_tasks(run_spec.spec, loaded.source)
    warn_about_plan(loaded)
    if args.dry_run:  # the data this machine can see (the rest lies on the cluster's volumes; prepare checks it)
        check_data([run_spec.spec for run_spec in selected_variants(args, loaded).values()] or [loaded.spec], True)
    compiled = compile_loaded(loaded, variant_switches(args, loaded) or None)
    if args.render is not None:
        written = render(compiled.documents(), args.render)
        for path in written:
            print(f"wrote {path}")
        to_apply = " ".join(f"-f {path}" for path in written if path.name != "workflow.yaml")
        print(f"next: kubectl apply --server-side {to_apply} && argo submit {args.render / 'workflow.yaml'}")
        return 0
    sys.stdout.write(to_yaml(compiled.documents()["workflow.yaml"]))
    return 0


if __name__ == "__main__":
    run_cli(main, None)

"""`python -m workflows.register`: create or update a pipeline's WorkflowTemplate and CronWorkflow on Argo.

    python -m workflows.register korean-llm
    python -m workflows.register korean-llm --set schedule.suspend=true
    python -m workflows.register qwen3-30b-a3b --profile qlora    # WorkflowTemplate qwen3-30b-a3b-qlora

Registering submits no run: the template becomes available in the Argo UI (with its parameter form) and the
schedule, when the spec has one, starts runs from it. With --profile P both are named `<pipeline>-P`. Here --set
values are compiled into the shared template, and so into every later run and scheduled run (a warning says so).
"""

from __future__ import annotations

import argparse
import sys

from workflows.argo import ArgoClient, ArgoError
from workflows.submit import add_pipeline_arguments, argo_client, check_lm_eval_tasks, compile_loaded, load, run_cli


def parser() -> argparse.ArgumentParser:
    """The command line."""
    from workflows.commands import add_version_option

    p = argparse.ArgumentParser(
        prog="python -m workflows.register",
        description="Create or update a pipeline's WorkflowTemplate and, when scheduled, its CronWorkflow.",
    )
    add_version_option(p)
    add_pipeline_arguments(p, "Compiled into the shared template, so every later run uses it.")
    return p


def main(argv: list[str] | None = None) -> int:
    """Register the pipeline and print what was created or updated; returns the exit code."""
    args = parser().parse_args(argv)
    loaded = load(args.pipeline, args.profile, args.overrides)
    check_lm_eval_tasks(loaded.spec, loaded.source)
    compiled = compile_loaded(loaded)
    name = compiled.template.name
    if args.overrides:
        print(
            f"warning: --set values are compiled into the shared WorkflowTemplate {name}: every run from it uses "
            "them, scheduled ones included, until it is registered or submitted again without them; for a single "
            "run, pass them to `python -m workflows.submit` instead",
            file=sys.stderr,
        )
    with argo_client(loaded) as client:
        print(client.ensure_workflow_template(compiled.template))
        if compiled.cron is not None:
            print(client.ensure_cron_workflow(compiled.cron))
            schedule = loaded.spec.schedule
            state = " (suspended)" if schedule.suspend else ""
            print(f"schedule: {', '.join(schedule.cron)} in {schedule.timezone}{state}")
        else:
            print(_unscheduled_note(client, name))
    return 0


def _unscheduled_note(client: ArgoClient, name: str) -> str:
    """What to tell when the spec has no schedule: whether an earlier CronWorkflow is still there."""
    try:
        existing = client.get_cron_workflow(name)
    except ArgoError:
        existing = None  # e.g. no 'get' on cronworkflows: the note is a courtesy, not worth failing for
    if existing is None:
        return "no schedule in the spec: no CronWorkflow"
    return (
        f"note: the spec has no schedule, but CronWorkflow {client.namespace}/{name} exists and still starts "
        f"runs; remove it with `argo cron delete -n {client.namespace} {name}`"
    )


if __name__ == "__main__":
    run_cli(main, None)
